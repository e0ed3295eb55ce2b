"""Sweeps RowTilings of the row-wise engine on the GPU, to set `rows.default_tiling`.

    PYTHONPATH=. python3 benchmarks/tune_rows.py --out benchmarks/results/tuning

Two kernels per shape: the softmax forward (statistics + map, every variant that fits
the shape) and a pure map (an identity RowOp: the kernel of every backward map and of
the split variant's second phase). Each row is one tiling, named in the impl column;
% is of the copy ceiling measured on the same shape.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import harness
import jaxsoftmax as js
from bench_softmax import SHAPES, SMOKE_SHAPES
from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax.rows import RowOp, RowTiling, default_tiling, row_call
from jaxsoftmax.rows.tiling import STREAM_BLOCK_BYTES

_IDENTITY = RowOp("identity", apply=lambda t, s: t.x.x)


def _name(t: RowTiling) -> str:
  return (f"{t.variant} {t.block_rows}x{t.block_cols}"
          + (f" c{t.chunk_blocks}" if t.variant == "split" else "")
          + f" w{t.num_warps}")


def reduction_tilings(rows, cols, dtype):
  stream = STREAM_BLOCK_BYTES // jnp.dtype(dtype).itemsize
  cols_pow2 = pl.next_power_of_2(cols)
  out = []
  if cols_pow2 <= 32768:
    for tile in sorted({cols_pow2, 4096, 8192, 16384}):
      if tile >= cols_pow2:
        for warps in sorted({max(4, min(16, tile // 512)), max(4, min(32, tile // 256))}):
          out.append(RowTiling("resident", tile // cols_pow2, cols_pow2, 1, warps))
  for block_cols in (stream // 4, stream // 2, stream):
    if block_cols < cols:
      for warps in (8, 16):
        out.append(RowTiling("online", 1, block_cols, 1, warps))
  if cols > 64 * stream:
    for block_cols in (stream // 2, stream):
      for chunk_blocks in (2, 4, 8):
        out.append(RowTiling("split", 1, block_cols, chunk_blocks, 16))
  return out


def map_tilings(rows, cols, dtype):
  del dtype
  cols_pow2 = pl.next_power_of_2(cols)
  out = []
  for tile, warps in ((8192, 16), (16384, 8), (16384, 16), (32768, 16)):
    block_cols = min(cols_pow2, tile)
    block_rows = min(pl.next_power_of_2(rows), max(1, tile // block_cols))
    out.append(RowTiling("split", block_rows, block_cols, 1, warps))
  return list(dict.fromkeys(out))


def tune_shape(report, shape, dtype):
  rows, cols = shape
  n = math.prod(shape)
  itemsize = jnp.dtype(dtype).itemsize
  keys = jax.random.split(jax.random.PRNGKey(1), harness.rotations(n * itemsize))
  x_sets = [((4 * jax.random.normal(k, shape, jnp.float32)).astype(dtype),) for k in keys]
  common = dict(shape=shape, dtype=jnp.dtype(dtype).name)
  copy, _ = harness.measure_ceilings(report, x_sets, shape=shape, dtype=dtype)
  default = default_tiling(rows, cols, dtype, reduces=True)
  for t in reduction_tilings(rows, cols, dtype):
    mark = " (default)" if t == default else ""
    report.measure(op="softmax", impl=_name(t) + mark, mode="fwd",
                   fn=lambda x, t=t: js.softmax(x, tiling=t), arg_sets=x_sets,
                   nbytes=2 * n * itemsize, ceiling_gbps=copy, **common)
  default = default_tiling(rows, cols, dtype, reduces=False)
  interpret = pallas.resolve_interpret(None)
  for t in map_tilings(rows, cols, dtype):
    mark = " (default)" if t == default else ""
    report.measure(op="map", impl=_name(t) + mark, mode="fwd",
                   fn=lambda x, t=t: row_call(_IDENTITY, (x,), tiling=t, interpret=interpret).out,
                   arg_sets=x_sets, nbytes=2 * n * itemsize, ceiling_gbps=copy, **common)


if __name__ == "__main__":
  harness.run("tune_rows", __doc__, SHAPES, SMOKE_SHAPES, tune_shape,
              lambda shape, dtype, modes: 2 + len(reduction_tilings(*shape, dtype))
              + len(map_tilings(*shape, dtype)))
