"""delta = rowsum(dO ∘ O), the term the attention backward subtracts from dP (docs/math.md,
"Attention"), as (B, N, rows) float32 from a Pallas kernel, the rows past T zero.

Why a kernel rather than XLA's fused einsum (`logits.row_delta`): under ``jax.vmap`` the
backward runs on the mapped elements folded into one batch (`_core.linear_map`), and
XLA tiles a reduction by its array's shape, so a row's sum may round otherwise than in
the element's own call, and with it dK (tests/test_attention.py,
`test_hopper_vmap_claims_items_gpu`): on an H100, 180853 of 262144 rows at 4x4096
with 16 heads of 128 (`benchmarks/results/tuning/bench_delta_vmap_h100.md`). Here a
row's sum is in the order this code fixes, whatever the batch. It also writes the
padding the Hopper backward's tiles of queries need, which was one more XLA pass.

A row reduction wants neither TMA nor wgmma, so the kernel is Pallas' Triton lowering's,
on a Hopper GPU too; the interpreter checks it on a CPU. It took 67.5 us against the
einsum's 66.0 from the float32 O there (same file), of a backward of milliseconds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl

# Queries a program: the rows of O and dO it reads are 64 x head dim, 32 KB of float32 O
# and 16 KB of bfloat16 dO at head dim 128.
BLOCK_ROWS = 64


def row_delta(o, do, *, rows: int, interpret: bool = False):
  """delta (B, N, rows) float32 for o and do (B, T, N, Hv) (o float32 or 16-bit, do
  16-bit): rowsum(dO ∘ O) for each query row below T, zero past it. ``rows``: a
  multiple of BLOCK_ROWS, at least T."""
  B, T, N, Hv = o.shape
  if do.shape != o.shape:
    raise ValueError(f"do must have o's shape {o.shape}, got {do.shape}")
  if rows < T or rows % BLOCK_ROWS:
    raise ValueError(f"rows must be a multiple of {BLOCK_ROWS} and at least T={T}, "
                     f"got {rows}")
  # Triton's blocks are powers of two: the head dim's block is padded past Hv, and the
  # loads read those columns and the rows past T as zeros (the mask's `other`), so that
  # they add nothing to a row's sum and the rows past T sum to zero.
  width = pl.next_power_of_2(Hv)
  block = pl.BlockSpec((None, BLOCK_ROWS, None, width), lambda n, t, b: (b, t, n, 0))

  def kernel(o_ref, do_ref, delta_ref):
    row = pl.program_id(1) * BLOCK_ROWS + jnp.arange(BLOCK_ROWS, dtype=jnp.int32)
    inside = (row < T)[:, None] & (jnp.arange(width, dtype=jnp.int32) < Hv)[None, :]
    o_tile = pallas.load(o_ref, mask=inside, other=0).astype(jnp.float32)
    do_tile = pallas.load(do_ref, mask=inside, other=0).astype(jnp.float32)
    delta_ref[...] = jnp.sum(o_tile * do_tile, axis=1)

  return pallas.pallas_call(
      kernel, name="attention_delta", grid=(N, rows // BLOCK_ROWS, B),
      in_specs=[block, block],
      out_specs=pl.BlockSpec((None, None, BLOCK_ROWS), lambda n, t, b: (b, n, t)),
      out_shape=jax.ShapeDtypeStruct((B, N, rows), jnp.float32),
      num_warps=4, num_stages=1, interpret=interpret)(o, do)
