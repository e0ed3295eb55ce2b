"""Sweeps the RowTiling of layer_norm's forward + backward on the GPU, to set the tiles
the norms take (`rowwise.default_tiling` today, tuned on softmax).

    PYTHONPATH=.:benchmarks python3 benchmarks/tune_norms.py --out benchmarks/results

bench_norms.py's shapes, layer_norm plain and with the residual, forward + backward (the
backward is where the defaults lose to XLA). The backward's column sums for dscale and
dbias ride in the resident kernel, each program walking blocks of ``block_rows`` rows and
carrying the sums of a whole row in registers; so the sweep varies the rows per block
and the warps of the resident variant, and adds the online variant (whose backward
takes XLA's column sums) where rows are long. % is of the copy ceiling over
bench_norms.py's minimum traffic; the impl column names the tiling.
"""

from __future__ import annotations

import jax.numpy as jnp

import harness
import jaxsoftmax as js
from bench_norms import EPS, SHAPES, SMOKE_SHAPES, _vjp, shape_inputs
from jaxsoftmax._backend import pl
from jaxsoftmax.rowwise import MAX_TILE_ELEMS, STREAM_BLOCK_BYTES, RowTiling


def _name(t: RowTiling) -> str:
  return f"{t.variant} {t.block_rows}x{t.block_cols} w{t.num_warps}"


def tilings(rows: int, cols: int, dtype) -> list[RowTiling]:
  """The default, then resident tiles of 1, 4 and 16 rows at twice the default's warps
  per element (the backward holds more values per element than the softmax the
  defaults were tuned on), and the online variant where rows are long."""
  cols_pow2 = pl.next_power_of_2(cols)
  out = [js.rowwise.default_tiling(rows, cols, dtype, reduces=True)]
  for block_rows in (1, 4, 16):
    elems = block_rows * cols_pow2
    if block_rows <= pl.next_power_of_2(rows) and elems <= MAX_TILE_ELEMS // 2:
      out.append(RowTiling("resident", block_rows, cols_pow2, 1,
                           max(4, min(32, elems // 256))))
  stream = STREAM_BLOCK_BYTES // jnp.dtype(dtype).itemsize
  if cols > stream:
    out.append(RowTiling("online", 1, stream, 1, 16))
  return list(dict.fromkeys(out))


def tune_shape(report: harness.Report, shape, dtype):
  rows, C = shape
  sets, scale, bias, n_bytes, common = shape_inputs(report, shape, dtype)
  default = js.rowwise.default_tiling(rows, C, dtype, reduces=True)
  for residual in (False, True):
    for t in tilings(rows, C, dtype):
      norm = lambda x, sc, bi, r, t=t: js.layer_norm(
          x, sc, bi, epsilon=EPS, residual=r if residual else None, tiling=t)
      both = _vjp(norm, residual)
      report.measure(op="layer_norm" + (" +res" if residual else ""),
                     impl=_name(t) + (" (default)" if t == default else ""), mode="fwd+bwd",
                     fn=lambda x, r, dy, dh, both=both: both(x, scale, bias, r, dy, dh),
                     arg_sets=[tuple(s) for s in sets],
                     nbytes=(8 if residual else 5) * n_bytes, **common)


if __name__ == "__main__":
  harness.run("tune_norms", __doc__, SHAPES, SMOKE_SHAPES, tune_shape,
              lambda shape, dtype: 2 + 2 * len(tilings(*shape, dtype)))
