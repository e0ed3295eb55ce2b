"""Sweeps the RowTiling of layer_norm's forward + backward on the GPU, to set the tiles
the norms take (`rowwise.default_tiling` today, tuned on softmax).

    PYTHONPATH=.:benchmarks python3 benchmarks/tune_norms.py --out benchmarks/results

bench_norms.py's shapes, layer_norm plain and with the residual, forward + backward (the
backward is where the defaults lose to XLA). The backward's column sums for dscale and
dbias ride in the resident kernel, each program walking blocks of ``block_rows`` rows and
carrying the sums of a whole row in registers; so the sweep varies the rows per block
and the warps of the resident variant, and adds the online variant (whose backward
takes XLA's column sums) where rows are long. Then the forwards of plain layer_norm
and rms_norm (layer_norm's runs at 64-81% of copy where rms_norm's reaches 97-101%) on
fewer warps a row (shorter cross-warp reductions, more programs per SM) and on twice the
rows a program (scale and bias loaded once for both). % is of the copy ceiling over
bench_norms.py's minimum traffic; the impl column names the tiling.
"""

from __future__ import annotations

import dataclasses

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


def forward_tilings(rows: int, cols: int, dtype) -> list[RowTiling]:
  """The default, then for a resident default: half and a quarter of its warps (at
  least 2), and twice its rows at twice its warps."""
  default = js.rowwise.default_tiling(rows, cols, dtype, reduces=True)
  out = [default]
  if default.variant == "resident":
    out += [dataclasses.replace(default, num_warps=w)
            for w in (default.num_warps // 2, default.num_warps // 4) if w >= 2]
    if (2 * default.block_rows <= pl.next_power_of_2(rows)
        and 2 * default.block_rows * default.block_cols <= MAX_TILE_ELEMS // 2):
      out.append(dataclasses.replace(default, block_rows=2 * default.block_rows,
                                     num_warps=min(32, 2 * default.num_warps)))
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
  for rms in (False, True):
    for t in forward_tilings(rows, C, dtype):
      if rms:
        norm = lambda x, t=t: js.rms_norm(x, scale, epsilon=EPS, tiling=t)
      else:
        norm = lambda x, t=t: js.layer_norm(x, scale, bias, epsilon=EPS, tiling=t)
      report.measure(op="rms_norm" if rms else "layer_norm",
                     impl=_name(t) + (" (default)" if t == default else ""), mode="fwd",
                     fn=norm, arg_sets=[(s[0],) for s in sets], nbytes=2 * n_bytes,
                     **common)


if __name__ == "__main__":
  harness.run("tune_norms", __doc__, SHAPES, SMOKE_SHAPES, tune_shape,
              lambda shape, dtype: 2 + 2 * len(tilings(*shape, dtype))
              + 2 * len(forward_tilings(*shape, dtype)))
