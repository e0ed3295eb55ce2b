"""softmax of long 16-bit rows staged in shared memory, for Hopper GPUs (Pallas Mosaic GPU).

The row engine's resident variant holds a row in registers, up to 16384 values; longer
rows take its online variant, which reads each row twice (once for the row's (m, l),
once to normalize): 3 passes of traffic instead of 2, and 79% of copy at 4096x32768
bfloat16 on the H200, where rows of 32768 held in the registers of 32 warps ran slower
still (benchmarks/results/README.md, "The row ops at their bound"). A 64 KB row fits
in shared memory (227 KB a CTA) three times over, so here each CTA walks a group of
rows through a ring of ``stages`` row slots:

- TMA loads row i + stages - 1 into the slot that row i - 1 left, once that row's own
  TMA store has read it, so the loads of the next rows overlap the work on this one;
- the warpgroup sweeps the row in shared memory three times, in blocks of
  ``BLOCK_COLS``: its max m, then l = Σ exp(x - m), then y = exp(x - m) / l written
  back over x in its slot (shared memory serves these reads many times faster than
  HBM the one it replaces);
- TMA stores the slot to y.

So HBM sees each row read once and written once. Not yet the default: it has not run on
a GPU (tests run it in Pallas' Mosaic GPU interpreter and lower it for CUDA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax import _backend
from jaxsoftmax._backend.mosaic_gpu import SMEM_BYTES, pl, plgpu

__all__ = ["softmax", "supported"]

_LOG2E = 1.4426950408889634
# A row moves as (C / 256, 256): TMA copies at most 256 elements along each dimension.
_LANE = 256
# Columns of a sweep's block: 16 float32 values a thread of the warpgroup.
BLOCK_COLS = 2048
_BLOCK_LINES = BLOCK_COLS // _LANE


def supported(shape, dtype, stages: int = 3) -> str | None:
  """Why `softmax` cannot take rows of this (R, C) shape and dtype, or None."""
  C = shape[-1]
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return f"it stages 16-bit rows, not {jnp.dtype(dtype)}"
  if C % BLOCK_COLS:
    return f"the row length ({C}) must be a multiple of {BLOCK_COLS}"
  needed = stages * C * jnp.dtype(dtype).itemsize + 1024
  if needed > SMEM_BYTES:
    return f"{stages} rows of {C} take {needed} bytes of shared memory, more than {SMEM_BYTES}"
  return None


def _kernel(x_ref, y_ref, slots, loaded, *, n_rows: int, per: int, stages: int):
  blocks = slots.shape[1] // _BLOCK_LINES
  first = lax.axis_index("ctas") * per
  rows = jnp.minimum(per, n_rows - first)  # the last group may be shorter

  def load(i):
    s = lax.rem(i, stages)
    plgpu.copy_gmem_to_smem(x_ref.at[first + i], slots.at[s], loaded.at[s])

  for i in range(stages - 1):
    pl.when(i < rows)(functools.partial(load, i))

  @pl.loop(0, rows)
  def _(i):
    @pl.when(i + stages - 1 < rows)
    def _():
      # Its slot is row i - 1's: wait until that row's store has read it.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      load(i + stages - 1)

    s = lax.rem(i, stages)
    plgpu.barrier_wait(loaded.at[s])
    row = slots.at[s]
    block = lambda j: row.at[pl.ds(j * _BLOCK_LINES, _BLOCK_LINES)]

    def values(j):  # the block in float32
      return block(j)[...].astype(jnp.float32)

    def exp(j, m):
      # (x - m)·log2 e, not x·log2 e - m·log2 e: x - m is exact (0 at the row's max),
      # where the product's rounding, or its fusion into an FMA, could leave the max
      # element a large positive exponent for large x (inf, then NaN).
      return jnp.exp2((values(j) - m) * _LOG2E)

    # Three sweeps over the slot: the max, Σ exp(x - max), then y. Each thread keeps its
    # own running values across blocks, so the warpgroup reduces across its threads
    # (through shared memory, with a barrier) once per sweep, not once per block. The
    # first block starts the carries, in the loads' layout.
    m = lax.fori_loop(1, blocks, lambda j, m: jnp.maximum(m, values(j)), values(0)).max()
    l = lax.fori_loop(1, blocks, lambda j, l: l + exp(j, m), exp(0, m)).sum()
    inverse = 1.0 / l

    @pl.loop(0, blocks)
    def _(j):
      block(j)[...] = (exp(j, m) * inverse).astype(row.dtype)

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(row, y_ref.at[first + i])

  plgpu.wait_smem_to_gmem(0)


def softmax(x, *, stages: int = 3, interpret: bool = False):
  """softmax over the last axis of 16-bit rows x (R, C), C a multiple of BLOCK_COLS and
  ``stages`` rows within shared memory (`supported`). ``interpret``: run in Pallas'
  Mosaic GPU interpreter on the CPU."""
  why = supported(x.shape, x.dtype, stages)
  if why is not None:
    raise ValueError(f"rowwise_hopper.softmax cannot take x {x.dtype} {x.shape}: {why}")
  R, C = x.shape
  # Two CTAs per SM would each hold fewer slots; one walks its share of the rows.
  ctas, per = _backend.even_groups(R, _backend.num_cores())
  lines = (C // _LANE, _LANE)
  return plgpu.kernel(
      functools.partial(_kernel, n_rows=R, per=per, stages=stages),
      out_type=jax.ShapeDtypeStruct((R, *lines), x.dtype),
      scratch_types=[plgpu.SMEM((stages, *lines), x.dtype),
                     plgpu.Barrier(num_arrivals=1, num_barriers=stages)],
      grid=(ctas,),
      grid_names=("ctas",),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      kernel_name="softmax_rows_smem_mosaic_gpu",
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(x.reshape(R, *lines)).reshape(R, C)
