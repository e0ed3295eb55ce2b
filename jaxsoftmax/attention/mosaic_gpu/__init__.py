"""The Hopper backend: FlashAttention-3's schedules (TMA, wgmma, warp specialization) in
Pallas Mosaic GPU, for compute capability 9.x (H100, H200).

The forward and the backward take bfloat16 and float16 inputs and head dims up to 256
(padded to a multiple of 64), and a value head dim other than the queries'. The backward
sums dQ with atomic adds, or, with ``deterministic=True``, takes it from a kernel of its
own (head dims up to 128) or puts the adds in a fixed order (above). Its residuals are
the Triton forward's, so that the Triton backward can take its calls too. It has no
interpret mode (see `jaxsoftmax._core.mosaic_gpu`).
"""

from __future__ import annotations

from jaxsoftmax._core import mosaic_gpu as _device
from jaxsoftmax._core.mosaic_gpu import SMEM_BYTES
from jaxsoftmax.attention.call import Call
from jaxsoftmax.attention.mosaic_gpu import backward as _backward
from jaxsoftmax.attention.mosaic_gpu import forward as _forward
from jaxsoftmax.attention.mosaic_gpu.forward import HopperBlockSizes, forward_head_dim

NAME = "mosaic_gpu"
MAX_HEAD_DIM = 256
DTYPES = ("bfloat16", "float16")
def unsupported(call: Call) -> str | None:
  """Why this backend cannot run ``call``, or None when it can."""
  if not _device.hopper_device():
    return ("it needs a Hopper GPU (compute capability 9.x); the default device is "
            f"{_device.device_description()}")
  if call.interpret:
    return "it has no interpret mode (interpret=True, or JAXSOFTMAX_INTERPRET=1)"
  if call.dtype not in DTYPES:
    return f"it takes bfloat16 or float16 inputs, got {call.dtype}"
  if max(call.H, call.Hv) > MAX_HEAD_DIM:
    return (f"head dims up to {MAX_HEAD_DIM}, got {call.H} (query, key) and {call.Hv} "
            "(value)")
  if call.score_terms:
    return (f"{', '.join(call.score_terms)} run in the Triton kernels, not the Hopper "
            "ones")
  if call.block_sizes is not None and not isinstance(call.block_sizes, HopperBlockSizes):
    return (f"block_sizes is a {type(call.block_sizes).__name__}; the Mosaic GPU kernel "
            "takes jaxsoftmax.HopperBlockSizes")
  needed = blocks(call).smem_bytes(forward_head_dim(call.H), call.itemsize,
                                   value_head_dim=forward_head_dim(call.Hv))
  if needed > SMEM_BYTES:
    return (f"{blocks(call)} need {needed} bytes of shared memory at head dims {call.H} "
            f"(query, key) and {call.Hv} (value), more than the {SMEM_BYTES} a block may "
            "use")
  return None


def defers(call: Call) -> str | None:
  """Why, though it can run ``call``, this backend leaves it to a later one when no
  implementation is named (`_core.backends.Registry`), or None."""
  if call.packed:
    return ("segment ids: the Triton kernels skip the tiles whose ids cannot match, "
            "these compare the ids on every tile (eight packed documents a row: 0.20x "
            "the plain Triton forward and 0.21x forward + backward, against 1.32x and "
            "1.11x the plain Hopper kernels', on an H100; docs/kernels.md)")
  return None


def blocks(call: Call) -> HopperBlockSizes:
  """The caller's Hopper tiles, else the defaults for the wider of the call's head dims
  (whose tiles take the most shared memory and registers), the values' where they
  differ, and its (batch row, query head) pairs."""
  if isinstance(call.block_sizes, HopperBlockSizes):
    return call.block_sizes
  return HopperBlockSizes.default(max(call.H, call.Hv), call.spec.is_causal,
                                  pairs=call.B * call.N,
                                  value_head_dim=call.Hv if call.Hv != call.H else None)


def fwd(q, k, v, aux_arrays, call: Call, *, float32_output: bool, sinks=None):
  """(o, m, log2_l[, o in float32]): see `mosaic_gpu.forward.forward`."""
  return _forward.forward(q, k, v, aux_arrays, spec=call.spec, blocks=blocks(call),
                          scale=call.scale, softcap=call.softcap,
                          float32_output=float32_output, sinks=sinks)


def backward_unsupported(call: Call) -> str | None:
  """Why the Hopper backward cannot differentiate ``call`` (run by this forward), or
  None when it can."""
  return _backward.unsupported(call.H, call.dtype, call.deterministic,
                              value_head_dim=call.Hv)


def bwd(q, k, v, o, m, log2_l, do, aux_arrays, call: Call, *, grad_dtype=None,
        delta=None):
  """(dq, dk, dv) from this forward's residuals; see `mosaic_gpu.backward`
  (``call.deterministic``: dQ from a kernel of its own, or atomic adds in a fixed
  order, instead of atomic adds)."""
  return _backward.backward(q, k, v, o, m, log2_l, do, aux_arrays, spec=call.spec,
                            scale=call.scale, softcap=call.softcap,
                            deterministic=call.deterministic, grad_dtype=grad_dtype,
                            delta=delta)


__all__ = ["NAME", "HopperBlockSizes", "unsupported", "fwd", "backward_unsupported", "bwd"]
