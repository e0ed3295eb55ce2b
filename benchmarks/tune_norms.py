"""Sweeps the warps of the norms' forward and backward kernels on the GPU, each timed
alone, to set the tilings the norms take.

    PYTHONPATH=.:benchmarks python3 benchmarks/tune_norms.py --out benchmarks/results

bench_norms.py's shapes; layer_norm and rms_norm, plain and with the residual. The
forward (mode "fwd") and the backward kernel alone (mode "bwd": `norms._normalize_bwd` on
the forward's saved h, mean and rstd, its column sums for dscale and dbias included) on
one resident row a program, at every warp count that leaves a thread between 4 and 128
float32 values of the row (64 for the backward, which holds h and dy), and at rows of
4096 columns or more the online variant on half and quarter rows and resident tiles of
two rows; then the tiling the norms take by default. The earlier H200 runs showed the
rows' defaults (tuned on softmax) to be the wrong trade for the norms: layer_norm's
forward at 16384x8192 bfloat16 ran at 65% of copy on 16 warps a row and 83% on 4.

Minimum traffic in (rows, C) arrays: forward 2 (read x, write y), 4 with the residual
(read x and residual, write y and h); backward 3 (read h and dy, write dh), 4 with the
residual (also h's cotangent). % is of the copy ceiling; the impl column names the tiling.

With ``TUNE_NORM_PARAMS=float32`` in the environment, scale and bias are float32 (Flax's
default param_dtype beside 16-bit activations) and the sweep is over rows a program
(`param_tilings`): each program loads the parameters once for all its rows, where one row
a program reads them again for every row (twice the bytes of a 16-bit row of x, from L2).
``--modes fwd`` or ``--modes bwd`` sweeps one of the two kernels (default: both).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

import harness
from bench_norms import EPS, SHAPES, SMOKE_SHAPES, shape_inputs
from jaxsoftmax.norms import api as norms
from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax.rows import RowTiling


def _name(t: RowTiling) -> str:
  return f"{t.variant} {t.block_rows}x{t.block_cols} w{t.num_warps}"


PARAMS = os.environ.get("TUNE_NORM_PARAMS")  # None: the activations' dtype


def tilings(cols: int, most_per_thread: int) -> list[RowTiling]:
  """Resident, one row a program, at 1 to 32 warps: those that leave a thread 4 to
  ``most_per_thread`` values of the row. For rows of 4096 columns or more, also the
  online variant on a half and a quarter of the row a block, 16 and 32 values a thread:
  its second read of the row, from L1 or L2 right after the first, trades against the
  registers a resident program holds the row in (what bounds layer_norm's wide rows); and
  resident tiles of two rows. With TUNE_NORM_PARAMS, `param_tilings` instead."""
  if PARAMS is not None:
    return param_tilings(cols, most_per_thread)
  cols_pow2 = pl.next_power_of_2(cols)
  out = [RowTiling("resident", 1, cols_pow2, 1, w) for w in (1, 2, 4, 8, 16, 32)
         if 4 <= cols_pow2 // (32 * w) <= most_per_thread]
  if cols_pow2 >= 4096:
    out += [RowTiling("online", 1, cols_pow2 // parts, 1, cols_pow2 // parts // (32 * v))
            for parts in (2, 4) for v in (16, 32)]
    # Two rows a tile on 16 and 32 warps: twice the rows in flight per program, while
    # the backward's column sums (reduced over the tile's rows first) stay one vector.
    out += [RowTiling("resident", 2, cols_pow2, 1, w) for w in (16, 32)
            if 2 * cols_pow2 // (32 * w) <= most_per_thread]
  return out


def param_tilings(cols: int, most_per_thread: int) -> list[RowTiling]:
  """Rows sharing one load of the parameters: resident tiles of 1 to 8 rows at 8 to
  ``most_per_thread`` values a thread (at most 64), and for rows of 4096 columns or more
  online tiles (half a row a block) of 1 to 4 rows at 8 to 32 values a thread."""
  cols_pow2 = pl.next_power_of_2(cols)
  out = []
  for variant, block_cols, most in (("resident", cols_pow2, most_per_thread),
                                    ("online", cols_pow2 // 2, 32)):
    if variant == "online" and cols_pow2 < 4096:
      continue
    for rows in (1, 2, 4, 8) if variant == "resident" else (1, 2, 4):
      for w in (1, 2, 4, 8, 16, 32):
        per_thread = rows * block_cols // (32 * w)
        if rows * block_cols <= 1 << 17 and 8 <= per_thread <= min(64, most):
          out.append(RowTiling(variant, rows, block_cols, 1, w))
  return out


def _norm(rms: bool, residual: bool, C: int, dtype, tiling) -> norms._Norm:
  params = (jax.ShapeDtypeStruct((), PARAMS or dtype),)
  return norms._Norm(rms, EPS, 0.0, C, jnp.dtype(dtype).name, residual, True, not rms,
                     tiling, pallas.resolve_interpret(None), norms._param_parts(dtype, params))


def tune_shape(report: harness.Report, shape, dtype):
  rows, C = shape
  sets, scale, bias, n_bytes, common = shape_inputs(report, shape, dtype)
  if PARAMS is not None:
    scale, bias = scale.astype(PARAMS), bias.astype(PARAMS)
  forward_saving = jax.jit(norms._normalize_fwd, static_argnums=4)
  for rms in (False, True):
    b = None if rms else bias
    for residual in (False, True):
      op = ("rms_norm" if rms else "layer_norm") + (" +res" if residual else "")
      default = _norm(rms, residual, C, dtype, None)
      # The saved values the backward reads: h, mean and rstd of each input set.
      saved = []
      for x, r, dy, dh in sets:
        _, (h, _, _, mean, rstd) = forward_saving(x, r if residual else None, scale, b,
                                                  default)
        saved.append((h, mean, rstd, dy, dh))

      def forward(x, r, t, rms=rms, residual=residual):
        return norms._normalize(x, r if residual else None, scale, b,
                                _norm(rms, residual, C, dtype, t))

      def backward(h, mean, rstd, dy, dh, t, rms=rms, residual=residual):
        return norms._normalize_bwd(_norm(rms, residual, C, dtype, t),
                                    (h, scale, b, mean, rstd), (dy, dh if residual else None))

      for mode, fn, most, args, traffic in (
          ("fwd", forward, 128, [(s[0], s[1]) for s in sets], 4 if residual else 2),
          ("bwd", backward, 64, saved, 4 if residual else 3)):
        if mode not in report.modes:
          continue
        for t in tilings(C, most) + [None]:
          report.measure(op=op, impl="default" if t is None else _name(t), mode=mode,
                         fn=lambda *a, fn=fn, t=t: fn(*a, t), arg_sets=args,
                         nbytes=traffic * n_bytes, **common)


def rows_per_shape(shape, dtype, modes) -> int:
  C = shape[1]
  counts = {"fwd": len(tilings(C, 128)) + 1, "bwd": len(tilings(C, 64)) + 1}
  return 2 + 4 * sum(counts[m] for m in modes if m in counts)


if __name__ == "__main__":
  harness.run("tune_norms", __doc__, SHAPES, SMOKE_SHAPES, tune_shape, rows_per_shape,
              default_modes="fwd,bwd")
