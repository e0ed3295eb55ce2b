"""Layer normalization and RMS normalization on the row engine, the residual add fused.

For each row h of C values (h = x + residual when a residual is given: added in float32,
rounded once to x's dtype, and returned, so that a pre-norm block's
``h = x + residual; y = norm(h)`` reads and writes each array once):

    layer_norm:  y = (h - mean) · rstd · scale + bias,      rstd = 1 / sqrt(var + ε)
    rms_norm:    y = h · rstd · (scale_offset + scale),     rstd = 1 / sqrt(mean(h²) + ε)

Statistics in float32: layer_norm's mean and variance from Welford states (n, mean, M2)
merged across column blocks and split programs, which keep the variance exact under a
large mean (docs/math.md, "Mean and variance"); rms_norm's mean square from a plain sum.
Outputs in x's dtype.

Derivatives in every mode: each norm is a ``jax.custom_jvp`` whose tangent is a
`linear_map.LinearMap` (below), which reverse mode transposes into the backward kernel,
from the saved per-row (mean, rstd), with x̂ = (h - mean)·rstd (mean = 0 for rms_norm)
and g = dy · γ (γ the effective scale):

    layer_norm:  dh = rstd · (g - (Σ g + x̂ · Σ g x̂) / C)
    rms_norm:    dh = rstd · (g - x̂ · Σ g x̂ / C)
    dscale = Σ_rows dy · x̂,   dbias = Σ_rows dy

one row-engine kernel for dh (the two row sums, then the map); the returned h's own
cotangent adds to dh, and dx = dresidual = dh. dscale and dbias come from the same
kernel where a row fits a program: each program walks several blocks of rows and writes
float32 partial column sums, which XLA adds up (deterministic, no atomics); for longer
rows XLA forms them from x̂ and dy in one more pass.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax._core import pallas
from jaxsoftmax._core.inputs import RowView, check_floating
from jaxsoftmax._core.linear_map import LinearMap
from jaxsoftmax.norms import reference
from jaxsoftmax.rows import RowOp, RowTiling, default_tiling, row_call
from jaxsoftmax.rows.backends import xla_path
from jaxsoftmax.rows.tiling import RESIDENT_MAX_COLS

__all__ = ["layer_norm", "rms_norm"]

# Values of a row each thread of the forward holds, by kind and input bytes, where a
# program holds one whole row of 1024 to RESIDENT_MAX_COLS columns; from the H200 sweep of
# every warp count, each kernel timed alone (benchmarks/results/tuning/tune_norms_warps.md).
# Fewer warps a row than the softmax defaults (16 values a thread) pay for 16-bit rows:
# layer_norm at 16384x8192 bfloat16 204 -> 162 us on 64 a thread, 65536x1024 77 -> 68 us
# (one warp); and for rms_norm's float32 rows: 8192x16384 348 -> 293 us on 128 a thread.
# layer_norm's float32 rows keep the defaults (None), which no warp count beat by more than
# the noise: 4096x4096 took 41 us on 16 a thread, 46 on 64; at 16384 columns 64 tied and
# 128 spilled to local memory (3479 us). The residual variants hold x, the residual and h:
# 32 matched or beat the defaults everywhere, 128 spilled.
_FORWARD_VALUES_PER_THREAD = {("layer_norm", 2): 64, ("layer_norm", 4): None,
                              ("rms_norm", 2): 64, ("rms_norm", 4): 128,
                              ("residual", 2): 32, ("residual", 4): 32}


@dataclasses.dataclass(frozen=True)
class _Norm:
  """The static choices of one normalization call."""

  rms: bool  # rms_norm (no mean, no bias) rather than layer_norm
  epsilon: float
  scale_offset: float
  n_cols: int
  dtype: str  # x's dtype: h is rounded to it
  has_residual: bool
  has_scale: bool
  has_bias: bool
  tiling: RowTiling | None
  interpret: bool
  param_parts: int = 1  # kernel column inputs per parameter (`_columns`)

  def part_names(self, param: str) -> tuple[str, ...]:
    """The kernels' column inputs that carry ``param`` ("scale" or "bias")."""
    if self.param_parts == 1:
      return (param,)
    return tuple(f"{param}_{i}" for i in range(self.param_parts))

  def col_names(self, *, bias: bool) -> tuple[str, ...]:
    """The kernels' column inputs, in `_columns`' order."""
    return ((self.part_names("scale") if self.has_scale else ())
            + (self.part_names("bias") if bias and self.has_bias else ()))

  def gamma(self, colvals):
    """The effective scale scale_offset + scale, (1, block_cols), from the kernel's
    column values; only with a scale."""
    return _joined([getattr(colvals, n) for n in self.part_names("scale")]) + self.scale_offset

  def beta(self, colvals):
    """The bias, (1, block_cols), from the kernel's column values; only with a bias."""
    return _joined([getattr(colvals, n) for n in self.part_names("bias")])

  def h(self, tile):
    """h as the kernels normalize it: x (+ residual, added in float32 and rounded to x's
    dtype, as it is returned)."""
    if not self.has_residual:
      return tile.x.x
    return (tile.x.x + tile.x.residual).astype(self.dtype).astype(jnp.float32)

  def rstd(self, stats):
    """rstd per row, (rows, 1) or (rows,), from the forward statistics."""
    if self.rms:
      return lax.rsqrt(stats.squares / self.n_cols + self.epsilon)
    return lax.rsqrt(stats.m2 / stats.n + self.epsilon)


def _forward_op(norm: _Norm) -> RowOp:
  def apply(tile, stats):
    h = norm.h(tile)
    y = h * norm.rstd(stats) if norm.rms else (h - stats.mean) * norm.rstd(stats)
    if norm.has_scale:
      y = y * norm.gamma(tile.colvals)
    if norm.has_bias:
      y = y + norm.beta(tile.colvals)
    return (y, h) if norm.has_residual else y

  names = dict(inputs=("x", "residual") if norm.has_residual else ("x",),
               col_inputs=norm.col_names(bias=True), apply=apply,
               outputs=1 + norm.has_residual)
  if norm.rms:
    return RowOp("rms_norm", sums={"squares": lambda t: jnp.square(norm.h(t))}, **names)
  return RowOp("layer_norm", moments_of=norm.h, **names)


def _backward_op(norm: _Norm) -> RowOp:
  """dh from inputs (h, dy[, dh_out: the cotangent of the returned h]) and row inputs
  (mean, rstd)."""

  def xhat(t):
    return (t.x.h - t.rows.mean) * t.rows.rstd

  def g(t):
    return t.x.dy if not norm.has_scale else t.x.dy * norm.gamma(t.colvals)

  def apply(t, stats):
    if norm.rms:
      dh = t.rows.rstd * (g(t) - xhat(t) * stats.gx / norm.n_cols)
    else:
      dh = t.rows.rstd * (g(t) - (stats.g + xhat(t) * stats.gx) / norm.n_cols)
    return dh + t.x.dh_out if norm.has_residual else dh

  sums = {"gx": lambda t: g(t) * xhat(t)}
  if not norm.rms:
    sums = {"g": g, **sums}
  # dscale and dbias: column sums of dy · x̂ and dy, in the same pass where the engine can.
  col_sums = {}
  if norm.has_scale:
    col_sums["dscale"] = lambda t: t.x.dy * xhat(t)
  if norm.has_bias:
    col_sums["dbias"] = lambda t: t.x.dy
  return RowOp(("rms_norm" if norm.rms else "layer_norm") + "_bwd",
               inputs=("h", "dy", "dh_out") if norm.has_residual else ("h", "dy"),
               row_inputs=("mean", "rstd"), col_inputs=norm.col_names(bias=False),
               sums=sums, apply=apply, col_sums=col_sums)


def _stats(norm: _Norm, stats):
  """(mean, rstd) per row, float32, from the forward kernel's statistics."""
  if norm.rms:
    return jnp.zeros_like(stats.squares), norm.rstd(stats)
  return stats.mean, norm.rstd(stats)


# float32 parameters beside 16-bit activations (Flax's default param_dtype in a
# mixed-precision model) reach the kernels as three bfloat16 parts each, whose float32 sum
# is the parameter (docs/numerics.md): the kernels' math stays float32 with the parameters
# exact, while every array a program loads has 16-bit elements.
def _param_parts(x_dtype, params) -> int:
  """How many bfloat16 parts the kernels read each parameter in: 3 for parameters wider
  than x's 16-bit elements, else 1 (the parameters as they are)."""
  wide = any(jnp.dtype(p.dtype).itemsize > 2 for p in params if p is not None)
  return 3 if jnp.dtype(x_dtype).itemsize == 2 and wide else 1


def _bfloat16_parts(p) -> tuple:
  """(hi, mid, lo) in bfloat16 with hi + mid + lo == p in float32, exactly for |p| above
  about 1e-31 (below, lo falls under float32's normal range and flushes): hi and mid take
  the next 8 bits of p's 24-bit significand by truncation, and each difference is exact.
  The cuts are on the bits, not by converting to bfloat16 and back: XLA on a GPU may drop
  such a round trip (its excess-precision rule), which left mid and lo zero. A NaN stays
  NaN and an infinity stays in hi."""
  p = p.astype(jnp.float32)
  top = lambda a: lax.bitcast_convert_type(
      lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32)
  hi = jnp.where(jnp.isnan(p), jnp.nan, top(p))
  rest = jnp.where(jnp.isfinite(p), p - hi, 0.0)
  mid = top(rest)
  as_bfloat16 = lambda a: lax.bitcast_convert_type(
      (lax.bitcast_convert_type(a, jnp.uint32) >> 16).astype(jnp.uint16), jnp.bfloat16)
  return as_bfloat16(hi), as_bfloat16(mid), as_bfloat16(rest - mid)


def _joined(parts):
  total = parts[0]
  for part in parts[1:]:
    total = total + part
  return total


def _columns(norm: _Norm, scale, bias) -> tuple:
  """The kernels' per-column inputs: scale and bias, those present, each as
  ``norm.param_parts`` arrays."""
  params = tuple(c for c in (scale, bias) if c is not None)
  if norm.param_parts == 1:
    return params
  return tuple(part for p in params for part in _bfloat16_parts(p))


def _forward_tiling(norm: _Norm, n_rows: int) -> RowTiling:
  """The forward's default: the rows' default, on fewer warps where a program holds one
  whole row of at least 1024 columns (see _FORWARD_VALUES_PER_THREAD), and layer_norm's
  rows of 8192 columns and more read twice in halves (the online variant, 8 warps): a
  whole row's mean and variance in registers cost more than the second read, which L2
  serves. On the H200 (benchmarks/results/tuning/tune_norms_online.md): 8192x16384 float32
  397 -> 339 us, 16384x8192 bfloat16 162 -> 156 us and with a residual 306 -> 291 us;
  8192x16384 float32 with a residual tied (705 / 707 us).

  float32 parameters beside 16-bit rows of 4096 or 8192 columns (`_param_parts`),
  without a residual: two rows a program, which read the parameters once for both
  (layer_norm online in halves, 32 values a thread; rms_norm resident on 16 warps).
  Their parts took the one-row programs to 116 registers a thread against 64 with
  bfloat16 parameters, and to half the occupancy (Nsight Compute, layer_norm 16384x8192
  bfloat16: 242 against 148 us). On the H200, each kernel alone
  (benchmarks/results/tuning/tune_norms_params.md, tune_norms_params_4096.md):
  at 16384x8192 bfloat16 layer_norm 2x4096 online on 8 warps 3208 GB/s against 2327 on
  one row, rms_norm 2x8192 on 16 warps 3604 against 3358; at 32768x4096 layer_norm 2x2048
  online on 4 warps 156.5 against 205.6 us, rms_norm 2x4096 on 16 warps 141.9 against
  148.4. With a residual the fastest tiles at 8192 columns held one row (layer_norm: the
  default, 3322 GB/s; rms_norm 3733 on 32 warps against the default's 3458, already
  ahead of XLA's)."""
  tiling = default_tiling(n_rows, norm.n_cols, norm.dtype, reduces=True)
  if (tiling.variant != "resident" or tiling.block_rows != 1
      or not 1024 <= tiling.block_cols <= RESIDENT_MAX_COLS):
    return tiling
  if (norm.param_parts > 1 and not norm.has_residual and tiling.block_cols in (4096, 8192)
      and n_rows > 1):
    if norm.rms:
      return RowTiling("resident", 2, tiling.block_cols, 1, 16)
    return RowTiling("online", 2, tiling.block_cols // 2, 1, tiling.block_cols // 1024)
  if not norm.rms and tiling.block_cols >= 8192:
    return RowTiling("online", 1, tiling.block_cols // 2, 1, 8)
  kind = "residual" if norm.has_residual else "rms_norm" if norm.rms else "layer_norm"
  per_thread = _FORWARD_VALUES_PER_THREAD[kind, jnp.dtype(norm.dtype).itemsize]
  if per_thread is None:
    return tiling
  warps = tiling.block_cols // (32 * per_thread)
  return dataclasses.replace(tiling, num_warps=min(32, max(1, warps)))


def _normalize_fwd(x, residual, scale, bias, norm: _Norm):
  inputs = (x,) if residual is None else (x, residual)
  outs, stats, _ = row_call(_forward_op(norm), inputs,
                            col_inputs=_columns(norm, scale, bias),
                            tiling=norm.tiling or _forward_tiling(norm, x.shape[0]),
                            interpret=norm.interpret)
  y, h = outs if norm.has_residual else (outs, x)
  mean, rstd = _stats(norm, stats)
  return (y, h if norm.has_residual else None), (h, scale, bias, mean, rstd)


def _backward_tiling(norm: _Norm, n_rows: int) -> RowTiling:
  """The backward's default: the rows' default, with two rows a program for rms_norm's
  16-bit rows of 8192 columns without a residual. On the H200 16384x8192 bfloat16 took
  340 -> 284 us (benchmarks/results/tuning/tune_norms_online.md); two rows were slower for
  layer_norm (359 -> 390 us), with a residual (341 -> 365) and at 8192x16384 float32."""
  tiling = default_tiling(n_rows, norm.n_cols, norm.dtype, reduces=True)
  if (norm.rms and not norm.has_residual and jnp.dtype(norm.dtype).itemsize == 2
      and tiling.variant == "resident" and tiling.block_rows == 1 and n_rows > 1
      and tiling.block_cols == 8192):
    return dataclasses.replace(tiling, block_rows=2)
  return tiling


def _normalize_bwd(norm: _Norm, saved, cotangents):
  h, scale, bias, mean, rstd = saved
  dy, dh_out = cotangents
  inputs = (h, dy) + ((dh_out,) if norm.has_residual else ())
  dh, _, col_sums = row_call(_backward_op(norm), inputs, (mean, rstd),
                             col_inputs=_columns(norm, scale, None),
                             tiling=norm.tiling or _backward_tiling(norm, h.shape[0]),
                             interpret=norm.interpret)
  # dscale and dbias, those present, from the kernel; None where the rows were too long
  # for one program (the online and split variants): then XLA's column sums.
  col_sums = {} if col_sums is None else col_sums._asdict()
  if any(total is None for total in col_sums.values()):
    dy32 = dy.astype(jnp.float32)
    xhat = _xhat(h, mean, rstd)
    col_sums = {}
    if norm.has_scale:
      col_sums["dscale"] = jnp.sum(dy32 * xhat, axis=0)
    if norm.has_bias:
      col_sums["dbias"] = jnp.sum(dy32, axis=0)
  dscale = col_sums["dscale"].astype(scale.dtype) if norm.has_scale else None
  dbias = col_sums["dbias"].astype(bias.dtype) if norm.has_bias else None
  return dh, dh if norm.has_residual else None, dscale, dbias


# --- derivatives: every mode, the kernels in reverse mode (`linear_map`) ---------------
# The tangent of (y, h) is linear in t = (dx[, dresidual][, dscale][, dbias]), from the
# residuals (h, scale, bias, mean, rstd), with dh = dx + dresidual and x̂ = (h - mean)·rstd:
#     dx̂ = rstd · (dh - mean(dh) - x̂ · mean(dh · x̂))     (rms_norm: no mean(dh) term)
#     dy = dx̂ · γ + x̂ · dscale + dbias;   the returned h moves by dh.
# Its transpose is the backward kernel (`_normalize_bwd`). Forward mode evaluates the
# map in jnp, second order differentiates the maps' jnp twins.


def _tangent_parts(norm: _Norm, t):
  """(dh, dscale, dbias) of the tangent inputs t, dh = dx (+ dresidual) in float32; None
  for a parameter the call does not have."""
  t = list(t)
  dh = t.pop(0).astype(jnp.float32)
  if norm.has_residual:
    dh = dh + t.pop(0).astype(jnp.float32)
  dscale = t.pop(0) if norm.has_scale else None
  dbias = t.pop(0) if norm.has_bias else None
  return dh, dscale, dbias


def _xhat(h, mean, rstd):
  return (h.astype(jnp.float32) - mean[:, None]) * rstd[:, None]


def _project_out(norm: _Norm, g, xhat, rstd):
  """rstd · (g - mean(g) - x̂ · mean(g · x̂)) per row (no mean(g) term for rms_norm): the
  normalization's derivative applied to g, self-adjoint."""
  centered = g if norm.rms else g - jnp.mean(g, axis=-1, keepdims=True)
  return rstd[:, None] * (centered - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))


def _gamma_of(norm: _Norm, scale):
  """The effective scale, (1, C) float32, in jnp."""
  return (scale.astype(jnp.float32) + norm.scale_offset)[None, :]


def _tangent_twin(res, t, *, norm: _Norm):
  h, scale, _, mean, rstd = res
  dh, dscale, dbias = _tangent_parts(norm, t)
  xhat = _xhat(h, mean, rstd)
  dy = _project_out(norm, dh, xhat, rstd)
  if norm.has_scale:
    dy = dy * _gamma_of(norm, scale) + xhat * dscale.astype(
        jnp.float32)[None, :]
  if norm.has_bias:
    dy = dy + dbias.astype(jnp.float32)[None, :]
  dy = dy.astype(norm.dtype)
  return (dy, dh.astype(norm.dtype)) if norm.has_residual else (dy,)


def _transpose_kernel(res, cts, *, norm: _Norm):
  dh, _, dscale, dbias = _normalize_bwd(norm, res, (cts[0], cts[1] if norm.has_residual
                                                    else None))
  return _cotangents(norm, dh, dscale, dbias)


def _cotangents(norm: _Norm, dh, dscale, dbias) -> tuple:
  """The cotangents of the tangent inputs t (dh for x and for the residual)."""
  return ((dh,) + ((dh,) if norm.has_residual else ()) + ((dscale,) if norm.has_scale else ())
          + ((dbias,) if norm.has_bias else ()))


def _transpose_twin(res, cts, *, norm: _Norm):
  h, scale, bias, mean, rstd = res
  dy = cts[0].astype(jnp.float32)
  xhat = _xhat(h, mean, rstd)
  g = dy * _gamma_of(norm, scale) if norm.has_scale else dy
  dh = _project_out(norm, g, xhat, rstd)
  if norm.has_residual:
    dh = dh + cts[1].astype(jnp.float32)
  dscale = jnp.sum(dy * xhat, axis=0).astype(scale.dtype) if norm.has_scale else None
  dbias = jnp.sum(dy, axis=0).astype(bias.dtype) if norm.has_bias else None
  return _cotangents(norm, dh.astype(h.dtype), dscale, dbias)


# Column arrays (scale, bias and their gradients) are not row by row: under vmap the maps
# run once per batch element, as the backward kernel's column sums do (`rows.row_call`).
_rows_only = lambda norm: not (norm.has_scale or norm.has_bias)
_TANGENT = LinearMap("norm_tangent", kernel=_tangent_twin, twin=_tangent_twin,
                     fold_rows=_rows_only).pair(
    LinearMap("norm_transpose", kernel=_transpose_kernel, twin=_transpose_twin,
              fold_rows=_rows_only))


def _tangent_inputs(norm: _Norm, tangents) -> tuple:
  dx, dresidual, dscale, dbias = tangents
  return ((dx,) + ((dresidual,) if norm.has_residual else ())
          + ((dscale,) if norm.has_scale else ()) + ((dbias,) if norm.has_bias else ()))


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _state(x, residual, scale, bias, norm: _Norm):
  """(y, h, mean, rstd): the outputs and the row statistics the derivatives use. Its own
  derivatives are needed at second order only; first order goes through `_normalize`."""
  (y, _), (h, _, _, mean, rstd) = _normalize_fwd(x, residual, scale, bias, norm)
  return y, h, mean, rstd


@_state.defjvp
def _state_jvp(norm: _Norm, primals, tangents):
  _, _, scale, bias = primals
  y, h, mean, rstd = _state(*primals, norm)
  t = _tangent_inputs(norm, tangents)
  dy, *_ = _TANGENT((h, scale, bias, mean, rstd), t, norm=norm)
  dh, _, _ = _tangent_parts(norm, t)
  # mean moves by mean(dh); rstd = (var + ε)^(-1/2) (or of mean(h²)) by -rstd² · mean(x̂ · dh).
  dmean = jnp.zeros_like(mean) if norm.rms else jnp.mean(dh, axis=-1)
  drstd = -rstd * rstd * jnp.mean(_xhat(h, mean, rstd) * dh, axis=-1)
  return (y, h, mean, rstd), (dy, dh.astype(h.dtype), dmean, drstd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _normalize(x, residual, scale, bias, norm: _Norm):
  """(y, h): h = x + residual when there is one, else None."""
  y, h, _, _ = _state(x, residual, scale, bias, norm)
  return y, h if norm.has_residual else None


@_normalize.defjvp
def _normalize_jvp(norm: _Norm, primals, tangents):
  _, _, scale, bias = primals
  y, h, mean, rstd = _state(*primals, norm)
  outs = _TANGENT((h, scale, bias, mean, rstd), _tangent_inputs(norm, tangents), norm=norm)
  if norm.has_residual:
    return (y, h), tuple(outs)
  return (y, None), (outs[0], None)


def _norm(op: str, x, residual, scale, bias, *, epsilon, axis, scale_offset, rms: bool,
          tiling, implementation, interpret):
  x = check_floating(x, "x", op)
  view = RowView.of(x.shape, axis, fn=op)
  features = tuple(x.shape[a] for a in view.axes)
  if residual is not None:
    residual = check_floating(residual, "residual", op)
    if residual.shape != x.shape or residual.dtype != x.dtype:
      raise ValueError(f"{op}: residual must have x's shape and dtype {x.dtype} {x.shape}, "
                       f"got {residual.dtype} {residual.shape}")
  for name, param in (("scale", scale), ("bias", bias)):
    if param is not None:
      param = check_floating(param, name, op)
      if param.shape not in (features, (view.n_cols,)):
        raise ValueError(f"{op}: {name} must have the normalized axes' shape {features}, "
                         f"got {param.shape} (x {x.shape}, axis {axis!r})")
  if not (isinstance(epsilon, (int, float)) and epsilon >= 0):
    raise ValueError(f"{op}: epsilon must be a number >= 0, got {epsilon!r}")
  if tiling is not None and not isinstance(tiling, RowTiling):
    raise TypeError(f"{op}: tiling must be a RowTiling, got {tiling!r}")
  scale = None if scale is None else jnp.asarray(scale)
  bias = None if bias is None else jnp.asarray(bias)
  if xla_path(op, x, implementation=implementation, interpret=interpret, tiling=tiling):
    return reference.normalize(x, residual, scale, bias, rms=rms, epsilon=float(epsilon),
                      scale_offset=float(scale_offset), view=view)
  norm = _Norm(rms, float(epsilon), float(scale_offset), view.n_cols, jnp.dtype(x.dtype).name,
               residual is not None, scale is not None, bias is not None, tiling,
               pallas.resolve_interpret(interpret), _param_parts(x.dtype, (scale, bias)))
  x, residual, scale, bias = pallas.vary_together(x, residual, scale, bias)
  rows = lambda a: None if a is None else view.to_rows(a)
  cols = lambda a: None if a is None else a.reshape(view.n_cols)
  y, h = _normalize(rows(x), rows(residual), cols(scale), cols(bias), norm)
  y = view.from_rows(y)
  return y if residual is None else (y, view.from_rows(h))


def layer_norm(x, scale=None, bias=None, *, epsilon: float = 1e-6, axis=-1, residual=None,
               tiling: RowTiling | None = None, implementation: str | None = None,
               interpret: bool | None = None):
  """Layer normalization over ``axis``: (h - mean) / sqrt(var + epsilon) · scale + bias.

  Args:
    x: float32, bfloat16 or float16 (float64 and empty arrays take the pure-jnp path).
    scale, bias: optional, the shape of x along ``axis``.
    epsilon: added to the variance.
    axis: the normalized axis (or axes).
    residual: optional, x's shape and dtype: the kernel normalizes h = x + residual
      (added in float32, rounded to x's dtype) and returns ``(y, h)``.
    tiling: optional `RowTiling` (see `jaxsoftmax.softmax`).
    implementation: None, "triton" or "xla"; see `jaxsoftmax.softmax`.
    interpret: run the kernels in Pallas interpret mode; see `jaxsoftmax.softmax`.

  Returns:
    y in x's dtype, or ``(y, h)`` with a residual.
  """
  return _norm("layer_norm", x, residual, scale, bias, epsilon=epsilon, axis=axis,
               scale_offset=0.0, rms=False, tiling=tiling, implementation=implementation,
               interpret=interpret)


def rms_norm(x, scale=None, *, epsilon: float = 1e-6, axis=-1, residual=None,
             scale_offset: float = 0.0, tiling: RowTiling | None = None,
             implementation: str | None = None, interpret: bool | None = None):
  """RMS normalization over ``axis``: h / sqrt(mean(h²) + epsilon) · (scale_offset + scale).

  ``scale_offset=1.0`` gives Gemma's (1 + scale). Other arguments as `layer_norm`.
  """
  return _norm("rms_norm", x, residual, scale, None, epsilon=epsilon, axis=axis,
               scale_offset=scale_offset, rms=True, tiling=tiling,
               implementation=implementation, interpret=interpret)
