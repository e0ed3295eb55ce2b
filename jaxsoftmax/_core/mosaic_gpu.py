"""Pallas' Mosaic GPU backend, for the Hopper kernels (compute capability 9.x).

The one module that imports it. Its kernels compile only for an sm_90a GPU: Pallas'
CPU interpreter for Mosaic GPU (``jax._src.pallas.mosaic_gpu.interpret``, JAX 0.12)
runs neither ``pl.run_state`` over wgmma accumulators nor wgmma with a register operand,
which FlashAttention's P V product needs, so the attention kernels have no interpret
mode; the linear cross-entropy forward, which needs neither, runs in it
(``plgpu.InterpretGPUParams``). The module imports everywhere, so that the package does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import memref

from jaxsoftmax._core.pallas import vary_over, varying_axes, varying_like

__all__ = ["pl", "plgpu", "hopper_device", "device_description", "pad_to", "compiler_params",
           "gpu_kernel", "warp_specialized_kernel", "rem32", "div32", "wgmma_iota",
           "per_row", "claim_next", "SMEM_BYTES"]

# Shared memory an H100/H200 block may use, in bytes.
SMEM_BYTES = 227 * 1024


def pad_to(x, axis: int, size: int, value=0):
  """x padded along ``axis`` to ``size`` with ``value`` (no copy when it has that size):
  TMA moves whole (8, 64) tiles of the swizzled shared-memory layout, so the kernels
  pad their operands' sizes to multiples of those."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def compiler_params(softcap) -> plgpu.CompilerParams:
  """The compiler parameters of every Hopper kernel here. Each orders its shared memory
  with its own barriers (TMA writes, wgmma reads, and no region read and written by one
  thread without them), so Pallas' automatic barriers are off; row reductions stay
  inside a warp, so no reduction scratch. tanh.approx costs soft-capped logits their
  float32 accuracy (the attention lse at 10x the reference's error on the H200), so a
  soft cap (``softcap`` not None) keeps the exact math."""
  return plgpu.CompilerParams(approx_math=softcap is None, unsafe_no_auto_barriers=True,
                              reduction_scratch_bytes=0)


def rem32(a, b):
  """lax.rem on int32 operands: under jax_enable_x64 a Python int divisor becomes int64,
  which lax.rem will not mix with the kernels' int32 indices."""
  return lax.rem(lax.convert_element_type(a, jnp.int32), lax.convert_element_type(b, jnp.int32))


def div32(a, b):
  """lax.div on int32 operands (see `rem32`)."""
  return lax.div(lax.convert_element_type(a, jnp.int32), lax.convert_element_type(b, jnp.int32))


def wgmma_iota(shape, dimension: int):
  """int32 indices along ``dimension`` of a register tile in the wgmma layout (a tile's
  rows or columns, for element masks)."""
  return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)


def per_row(x, shape):
  """A per-row vector broadcast along the columns of a (rows, columns) register tile."""
  return lax.broadcast_in_dim(x, shape, [0])


def gpu_kernel(body, *, out_type, **options):
  """``plgpu.kernel(body, out_type=..., **options)``, its outputs declared to vary over
  the mesh axes its operands vary over (`jaxsoftmax._core.pallas.varying_like`), so that it
  runs inside `jax.shard_map` with ``check_vma=True``."""
  def call(*args):
    outs = plgpu.kernel(body, out_type=varying_like(out_type, args), **options)(*args)
    # JAX 0.11's plgpu.kernel returns invariant outputs whatever out_type says.
    return vary_over(outs, varying_axes(args))
  return call


def warp_specialized_kernel(body, *, out_type, consumers: int, name: str, softcap=None,
                            interpret: bool = False, **options):
  """`gpu_kernel` for the schedule every Hopper kernel here shares: ``consumers``
  consumer warpgroups and one producer (the thread axis "wg"), the shared
  `compiler_params`, and with ``interpret`` Pallas' Mosaic GPU interpreter. ``options``:
  the scratch, grid and grid names."""
  return gpu_kernel(body, out_type=out_type, num_threads=consumers + 1, thread_name="wg",
                    compiler_params=compiler_params(softcap), kernel_name=name,
                    interpret=plgpu.InterpretGPUParams() if interpret else None, **options)


def on_warps(*tasks):
  """Runs ``tasks[w]`` on warp w of the calling warpgroup (a producer's), each as a
  single warp; the warpgroup's other warps skip to the kernel's end rather than run
  through the loads and their waits beside the consumers, as FlashAttention-3's idle
  producer warps leave."""
  @plgpu.warp_map
  def _(warp):
    for w, task in enumerate(tasks):
      pl.when(warp == w)(task)


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
def claim_next(_, counter, slot):
  """slot[0] = counter[0]++: one thread of the calling warpgroup adds 1 to ``counter``
  (an int32 in global memory, from ``pl.get_global``) and writes the value it held to
  ``slot`` (int32 (1,) in shared memory); then the warpgroup meets at a barrier, so
  that its arrival on a barrier after this call carries the write to whoever waits
  there. Pallas has no atomic add that returns the old value, so it is PTX's
  ``atom.add``, relaxed: the counter orders nothing but the claims themselves."""
  i32 = ir.IntegerType.get_signless(32)
  with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
    old = mgpu_utils.inline_ptx("atom.relaxed.gpu.global.add.u32 $0, [$1], $2;",
                                mgpu_utils.memref_ptr(counter), mgpu_utils.c(1, i32),
                                result_types=i32, has_side_effects=True)
    memref.store(old, slot, [mgpu_utils.c(0, ir.IndexType.get())])
  mgpu_utils.warpgroup_barrier()


def producer_loads(loads, one_warp: bool):
  """Runs a producer warpgroup's ``loads``: by its first warp alone (`on_warps`) where
  ``one_warp``, else by all four warps."""
  if one_warp:
    on_warps(loads)
  else:
    loads()


@functools.cache
def _default_device():
  return jax.devices()[0]


def device_description() -> str:
  """The default device, as an error message names it."""
  device = _default_device()
  capability = getattr(device, "compute_capability", None)
  kind = getattr(device, "device_kind", device.platform)
  return f"{kind}" + (f" (compute capability {capability})" if capability else "")


def hopper_device() -> bool:
  """Whether JAX's default device is a Hopper GPU (compute capability 9.x)."""
  device = _default_device()
  if device.platform != "gpu":
    return False
  return str(getattr(device, "compute_capability", "")).startswith("9")

