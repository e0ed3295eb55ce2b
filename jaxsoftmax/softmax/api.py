"""softmax, log_softmax and logsumexp as Pallas kernels, differentiable in every mode.

Drop-ins for jax.nn.softmax, jax.nn.log_softmax and jax.nn.logsumexp: same arguments
(``axis`` an int, a tuple or None; ``where``), same results within dtype tolerance, same
handling of -inf and of masked elements. Inputs are float32, bfloat16 or float16 and
are accumulated in float32; float64 inputs (under ``jax_enable_x64``) and empty arrays
take the pure-jnp path of `jaxsoftmax.reference`.

Forward (x of R rows of C elements, reduced axes last; `rows` picks the variant),
from the row state m = max(x), l = sum(exp(x - m)):

    softmax = exp(x - m) / l;  log_softmax = (x - m) - log(l);  logsumexp = m + log(l)

Derivatives: each op is a ``jax.custom_jvp`` whose tangent is a `linear_map.LinearMap`
of what the forward saved (never an extra R x C tensor); reverse mode transposes it,
which runs the backward kernel. With p = exp(x - m) / l = exp(log_softmax):

    op            tangent                        backward (transpose)        saves
    softmax:      dy = y · (dx - sum(dx · y))    the same map (self-adjoint)  y
    log_softmax:  dy = dx - sum(p · dx)          dx = dy - p · sum(dy)        x, m, l
    logsumexp:    dy = sum(p · dx)               dx = g · p                   x, m, l

(m and l float32.) Forward mode evaluates the tangent (for log_softmax and logsumexp a
jnp reduction), second order goes through the maps' jnp twins.

Keeping (m, l) rather than lse = m + log(l) keeps float32 accuracy for large |x|: x - lse
would carry the rounding error of lse, an ulp of |x|, into every output.

Minimum memory traffic per call: forward 2·R·C elements (read x, write y), backward
3·R·C. Reducing over axes that are not the last ones costs a transpose on each side.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxsoftmax.softmax import reference
from jaxsoftmax._core import pallas
from jaxsoftmax._core.linear_map import LinearMap
from jaxsoftmax._core.inputs import RowView, check_floating, check_where
from jaxsoftmax.rows import RowOp, RowTiling, row_call
from jaxsoftmax.rows.backends import xla_path
from jaxsoftmax._core.state import nan_for_inf, probabilities, safe_shift, state_lse

__all__ = ["softmax", "log_softmax", "logsumexp"]

# A row holding +inf gives NaN throughout (`state.nan_for_inf`), as jax.nn.
_SOFTMAX = RowOp("softmax", state_of=lambda t: t.x.x,
                 apply=lambda t, s: t.e * (1 / nan_for_inf(s.l)))
_LOG_SOFTMAX = RowOp("log_softmax", state_of=lambda t: t.x.x,
                     apply=lambda t, s: (t.x.x - s.m) - jnp.log(nan_for_inf(s.l)),
                     fill=-jnp.inf)
_LOGSUMEXP = RowOp("logsumexp", state_of=lambda t: t.x.x)
# Backward ops; m is the finite shift the forward used.
_SOFTMAX_BWD = RowOp("softmax_bwd", inputs=("y", "dy"),
                     sums={"y_dy": lambda t: t.x.y * t.x.dy},
                     apply=lambda t, s: t.x.y * (t.x.dy - s.y_dy))
_LOG_SOFTMAX_BWD = RowOp(
    "log_softmax_bwd", inputs=("x", "dy"), row_inputs=("m", "l"),
    sums={"dy": lambda t: t.x.dy},
    apply=lambda t, s: t.x.dy - t.exp(t.x.x - t.rows.m) * (s.dy / t.rows.l))
_LOGSUMEXP_BWD = RowOp(
    "logsumexp_bwd", row_inputs=("g", "m", "l"),
    apply=lambda t, s: t.exp(t.x.x - t.rows.m) * (t.rows.g / t.rows.l))


def _normalized(name: str, on_xla, on_kernels, x, axis, where, tiling, implementation,
                interpret):
  """softmax and log_softmax as the public functions run them: the checks, then the XLA
  path (``on_xla``, jnp in float32 at least) or the kernels (``on_kernels``), as
  `rows.backends.xla_path` decides."""
  x = check_floating(x, "x", name)
  view = RowView.of(x.shape, axis, fn=name)
  where = check_where(where, x.shape, name)
  if xla_path(name, x, implementation=implementation, interpret=interpret, tiling=tiling):
    return reference.accumulated(on_xla, x, view.axes, where)
  x, where = pallas.vary_together(x, where)
  return on_kernels(x, where, view=view, tiling=tiling,
                    interpret=pallas.resolve_interpret(interpret))


def _rows_or_none(view: RowView, a):
  return None if a is None else view.to_rows(a)


def _row_dot(p, t):
  """sum(p · t) of each row, float32: how a tangent t moves log(l)."""
  return jnp.sum(p * t.astype(jnp.float32), axis=-1)


# --- softmax ---------------------------------------------------------------------------
# Tangent: dy = y · (dx - sum(dx · y)), self-adjoint: the backward kernel is the tangent
# map's kernel both ways.


def _softmax_tangent_kernel(res, t, *, tiling, interpret):
  y, where = res
  result = row_call(_SOFTMAX_BWD, (y, t[0]), where=where, tiling=tiling,
                    interpret=interpret)
  return (result.out,)


def _softmax_tangent_twin(res, t, *, tiling, interpret):
  del tiling, interpret
  y, dx = res[0], t[0]
  return (y * (dx - jnp.sum(dx * y, axis=-1, keepdims=True)),)


_SOFTMAX_TANGENT = LinearMap("softmax_tangent", kernel=_softmax_tangent_kernel,
                             twin=_softmax_tangent_twin)
_SOFTMAX_TANGENT.pair(_SOFTMAX_TANGENT)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _softmax_rows(x, where, tiling, interpret):
  return row_call(_SOFTMAX, (x,), where=where, tiling=tiling, interpret=interpret).out


@_softmax_rows.defjvp
def _softmax_rows_jvp(tiling, interpret, primals, tangents):
  x, where = primals
  y = _softmax_rows(x, where, tiling, interpret)
  dy, = _SOFTMAX_TANGENT((y, where), (tangents[0],), tiling=tiling, interpret=interpret)
  return y, dy


@functools.partial(jax.jit, static_argnames=("view", "tiling", "interpret"))
def _softmax(x, where, *, view, tiling, interpret):
  y = _softmax_rows(view.to_rows(x), _rows_or_none(view, where), tiling, interpret)
  return view.from_rows(y)


def softmax(x, axis=-1, where=None, *, tiling: RowTiling | None = None,
            implementation: str | None = None, interpret: bool | None = None) -> jax.Array:
  """Softmax over ``axis``, as jax.nn.softmax.

  Args:
    x: float32, bfloat16 or float16 array (float64 takes the reference path).
    axis: the axis or axes to normalize over.
    where: optional boolean mask broadcastable to ``x``: masked elements are left out of
      the sum and get 0.
    tiling: optional `RowTiling` to force a kernel variant and block sizes (forward and
      backward); None picks one from the shape.
    implementation: None (the kernels where they run, the XLA path off a GPU), "triton"
      (the row engine's Pallas kernels; interpreted off a GPU) or "xla" (plain jnp in
      float32 at least, `reference`).
    interpret: run the kernels in Pallas interpret mode; None decides from
      ``JAXSOFTMAX_INTERPRET`` or the default backend.

  Returns:
    An array like ``x``. A row whose elements are all -inf gives NaN, as in jax.nn; a
    row that ``where`` masks entirely gives 0.
  """
  return _normalized("softmax", reference.softmax, _softmax, x, axis, where, tiling,
                     implementation, interpret)


# --- log_softmax -----------------------------------------------------------------------


# Tangent: dy = dx - sum(p · dx) (0 where masked), from the residuals (x, m, l); its
# transpose, dx = dy - p · sum(dy), is the backward kernel.


def _log_softmax_tangent_twin(res, t, *, interpret):
  del interpret
  x, m, l, where = res
  dx = t[0]
  dy = dx - _row_dot(probabilities(x, m, l, where), dx)[:, None].astype(dx.dtype)
  return (dy if where is None else jnp.where(where, dy, 0).astype(dx.dtype),)


def _log_softmax_transpose_kernel(res, t, *, interpret):
  x, m, l, where = res
  return (row_call(_LOG_SOFTMAX_BWD, (x, t[0]), (m, l), where=where,
                   interpret=interpret).out,)


def _log_softmax_transpose_twin(res, t, *, interpret):
  del interpret
  x, m, l, where = res
  dy = t[0] if where is None else jnp.where(where, t[0], 0)
  dx = dy - probabilities(x, m, l, where) * jnp.sum(dy.astype(jnp.float32), axis=-1,
                                                     keepdims=True)
  return (dx.astype(t[0].dtype),)


_LOG_SOFTMAX_TANGENT = LinearMap("log_softmax_tangent", kernel=_log_softmax_tangent_twin,
                                 twin=_log_softmax_tangent_twin).pair(
    LinearMap("log_softmax_transpose", kernel=_log_softmax_transpose_kernel,
              twin=_log_softmax_transpose_twin))


def _with_state(name: str, forward, tangent: LinearMap):
  """The custom_jvp of an op whose tangent map takes the residuals (x, m, l), with
  ``forward(x, where, tiling, interpret) -> (y, m, l)`` its kernel and m made finite.

  Two levels: first order differentiates the op, whose rule needs (m, l) only as
  values; second order differentiates the state too, through its own rule (m is a
  shift, any finite value works, so it has no tangent; l = sum(exp(x - m)) moves by
  l · sum(p · dx)). With one level, reverse mode would save the dead tangent of l.
  """

  @functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
  def state(x, where, tiling, interpret):
    return forward(x, where, tiling, interpret)

  def tangent_of(x, where, interpret, m, l, dx):
    dy, = tangent((x, m, l, where), (dx,), interpret=interpret)
    return dy

  @state.defjvp
  def state_jvp(tiling, interpret, primals, tangents):
    (x, where), dx = primals, tangents[0]
    y, m, l = state(x, where, tiling, interpret)
    dl = l * _row_dot(probabilities(x, m, l, where), dx)
    return (y, m, l), (tangent_of(x, where, interpret, m, l, dx), jnp.zeros_like(m), dl)

  @functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
  def rows(x, where, tiling, interpret):
    return state(x, where, tiling, interpret)[0]

  @rows.defjvp
  def rows_jvp(tiling, interpret, primals, tangents):
    (x, where), dx = primals, tangents[0]
    y, m, l = state(x, where, tiling, interpret)
    return y, tangent_of(x, where, interpret, m, l, dx)

  rows.__name__ = state.__name__ = name
  return rows


def _log_softmax_forward(x, where, tiling, interpret):
  y, stats, _ = row_call(_LOG_SOFTMAX, (x,), where=where, tiling=tiling,
                         interpret=interpret)
  # A row holding +inf: NaN gradients too, from l = NaN.
  return y, safe_shift(stats.m), nan_for_inf(stats.l)


_log_softmax_rows = _with_state("log_softmax", _log_softmax_forward, _LOG_SOFTMAX_TANGENT)


@functools.partial(jax.jit, static_argnames=("view", "tiling", "interpret"))
def _log_softmax(x, where, *, view, tiling, interpret):
  y = _log_softmax_rows(view.to_rows(x), _rows_or_none(view, where), tiling, interpret)
  return view.from_rows(y)


def log_softmax(x, axis=-1, where=None, *, tiling: RowTiling | None = None,
                implementation: str | None = None,
                interpret: bool | None = None) -> jax.Array:
  """Log-softmax over ``axis``, as jax.nn.log_softmax.

  Arguments as `softmax`. Masked elements get -inf; a row of -inf gives NaN, as jax.nn.
  """
  return _normalized("log_softmax", reference.log_softmax, _log_softmax, x, axis, where,
                     tiling, implementation, interpret)


# --- logsumexp -------------------------------------------------------------------------


# Tangent: d lse = sum(p · dx), from the residuals (x, m, l); its transpose, dx = g · p, is
# the backward kernel (a pure map, tiled on its own).


def _logsumexp_tangent_twin(res, t, *, interpret):
  del interpret
  x, m, l, where = res
  return (_row_dot(probabilities(x, m, l, where), t[0]),)


def _logsumexp_transpose_kernel(res, t, *, interpret):
  x, m, l, where = res
  return (row_call(_LOGSUMEXP_BWD, (x,), (t[0], m, l), where=where,
                   interpret=interpret).out,)


def _logsumexp_transpose_twin(res, t, *, interpret):
  del interpret
  x, m, l, where = res
  p = probabilities(x, m, l, where)
  return ((t[0][:, None] * p).astype(x.dtype),)


_LOGSUMEXP_TANGENT = LinearMap("logsumexp_tangent", kernel=_logsumexp_tangent_twin,
                               twin=_logsumexp_tangent_twin).pair(
    LinearMap("logsumexp_transpose", kernel=_logsumexp_transpose_kernel,
              twin=_logsumexp_transpose_twin))


def _logsumexp_forward(x, where, tiling, interpret):
  stats = row_call(_LOGSUMEXP, (x,), where=where, tiling=tiling, interpret=interpret).stats
  return state_lse(stats.m, stats.l), safe_shift(stats.m), stats.l


_logsumexp_rows = _with_state("logsumexp", _logsumexp_forward, _LOGSUMEXP_TANGENT)


@functools.partial(jax.jit, static_argnames=("view", "keepdims", "tiling", "interpret"))
def _logsumexp(x, where, *, view, keepdims, tiling, interpret):
  lse = _logsumexp_rows(view.to_rows(x), _rows_or_none(view, where), tiling, interpret)
  return view.from_row_values(lse, keepdims=keepdims).astype(x.dtype)


def logsumexp(x, axis=None, b=None, keepdims: bool = False, return_sign: bool = False,
              where=None, *, tiling: RowTiling | None = None,
              implementation: str | None = None, interpret: bool | None = None):
  """log(sum(b · exp(x))) over ``axis`` (all axes when None), as jax.nn.logsumexp.

  Arguments as `softmax`, plus ``keepdims``, and jax.nn.logsumexp's ``b`` (weights,
  broadcastable to ``x``) and ``return_sign`` (also return the sign of the sum, the
  result being the log of its absolute value). With either of those two the call is
  jax.nn.logsumexp's own (XLA; a negative sum gives NaN without ``return_sign``, as
  there); without them, the kernels. The result has the dtype of ``x`` (the kernels
  accumulate in float32); an all -inf or fully masked row gives -inf, a +inf element +inf.
  """
  x = check_floating(x, "x", "logsumexp")
  view = RowView.of(x.shape, axis, fn="logsumexp")
  where = check_where(where, x.shape, "logsumexp")
  if b is not None or return_sign:
    if b is not None:  # explicitly: callers may run with rank promotion disallowed
      b = jnp.broadcast_to(jnp.asarray(b), x.shape)
    return jax.nn.logsumexp(x, axis=view.axes, b=b, keepdims=keepdims,
                            return_sign=return_sign, where=where)
  if xla_path("logsumexp", x, implementation=implementation, interpret=interpret,
               tiling=tiling):
    return reference.accumulated(reference.logsumexp, x, view.axes, where, keepdims)
  x, where = pallas.vary_together(x, where)
  return _logsumexp(x, where, view=view, keepdims=keepdims, tiling=tiling,
                    interpret=pallas.resolve_interpret(interpret))
