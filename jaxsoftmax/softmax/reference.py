"""The softmax family's reference: softmax, log_softmax and logsumexp.

Pure jnp in the dtype of the inputs: the truth every kernel is checked against (the
tests evaluate it in float64, and in the input dtype for the error that dtype allows:
the 2x rule, docs/testing.md and `tests/tolerance.py`), and the op's XLA path (float64,
empty inputs, and by default off a GPU). It follows jax.nn / optax semantics, including
`where` and -inf handling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsoftmax._core.state import nan_for_inf

__all__ = ["accumulated", "logsumexp", "softmax", "log_softmax"]


def accumulated(fn, x, *args, **kwargs):
  """``fn(x, ...)`` computed in float32 at least (x upcast; float64 stays), the result in
  x's dtype: the ops' XLA path, which keeps the kernels' float32 accumulation."""
  return fn(x.astype(jnp.promote_types(x.dtype, jnp.float32)), *args, **kwargs).astype(x.dtype)


def _axes(x, axis):
  return tuple(range(x.ndim)) if axis is None else axis


def _state(x, axis, where):
  """The row state (m, l) with m made finite, over ``axis`` with keepdims.

  m carries no gradient (as in jax.nn): the results do not depend on it.
  """
  masked = x if where is None else jnp.where(where, x, -jnp.inf)
  # The initial value makes an empty axis an empty state, as in jax.nn.
  m = jnp.max(masked, axis=axis, keepdims=True, initial=-jnp.inf)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
  return m, jnp.sum(jnp.exp(masked - m), axis=axis, keepdims=True)


def _log_l(l, axis, where):
  if where is None:
    return jnp.log(l)
  # log(0) on a row that `where` masks entirely would send 0/0 = NaN into the gradient.
  some = jnp.any(where, axis=axis, keepdims=True)
  return jnp.where(some, jnp.log(jnp.where(some, l, 1)), -jnp.inf)


def logsumexp(x, axis=None, where=None, keepdims=False):
  """log(sum(exp(x))) over ``axis`` (all axes for None), as jax.nn.logsumexp.

  A row that ``where`` masks entirely gives -inf with a zero gradient (no NaN); a row of
  -inf values gives -inf with a NaN gradient, as jax.nn.
  """
  axis = _axes(x, axis)
  m, l = _state(x, axis, where)
  out = m + _log_l(l, axis, where)
  return out if keepdims else jnp.squeeze(out, axis=axis)


def softmax(x, axis=-1, where=None):
  """exp(x - m) / l; 0 where ``where`` is False, as jax.nn.softmax (NaN on a row
  holding +inf)."""
  m, l = _state(x, axis, where)
  l = nan_for_inf(l)
  shifted = x - m
  if where is not None:
    shifted = jnp.where(where, shifted, -jnp.inf)  # exp(-inf) = 0, with a 0 gradient
    l = jnp.where(jnp.any(where, axis=axis, keepdims=True), l, 1)
  return jnp.exp(shifted) / l


def log_softmax(x, axis=-1, where=None):
  """(x - m) - log(l); -inf where ``where`` is False, as jax.nn.log_softmax (NaN on a
  row holding +inf)."""
  return _log_softmax(x, axis, where, nan_for_infinite_rows=True)


def _log_softmax(x, axis, where, *, nan_for_infinite_rows=False):
  m, l = _state(x, axis, where)
  if nan_for_infinite_rows:
    l = nan_for_inf(l)
  y = (x - m) - _log_l(l, axis, where)
  return y if where is None else jnp.where(where, y, -jnp.inf)
