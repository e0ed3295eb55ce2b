"""Pure-jnp references: the truth every kernel is checked against.

Each function computes in the dtype of its input, so the tests evaluate it twice: in
float64 for the truth, and in the input's own dtype for the error that dtype allows
(the 2x rule, DESIGN §6). They follow jax.nn / optax semantics, including `where` and
-inf handling, and are also the path jaxsoftmax takes for float64 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["logsumexp", "softmax", "log_softmax", "cross_entropy"]


def _axes(x, axis):
  return tuple(range(x.ndim)) if axis is None else axis


def logsumexp(x, axis=None, where=None, keepdims=False):
  """log(sum(exp(x))) over ``axis`` (all axes for None), as jax.nn.logsumexp."""
  axis = _axes(x, axis)
  masked = x if where is None else jnp.where(where, x, -jnp.inf)
  m = jnp.max(masked, axis=axis, keepdims=True)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
  out = jnp.log(jnp.sum(jnp.exp(masked - m), axis=axis, keepdims=True)) + m
  return out if keepdims else jnp.squeeze(out, axis=axis)


def softmax(x, axis=-1, where=None):
  """exp(x - logsumexp(x)); 0 where ``where`` is False, as jax.nn.softmax."""
  y = jnp.exp(x - logsumexp(x, axis, where, keepdims=True))
  return y if where is None else jnp.where(where, y, 0)


def log_softmax(x, axis=-1, where=None):
  """x - logsumexp(x); -inf where ``where`` is False, as jax.nn.log_softmax."""
  y = x - logsumexp(x, axis, where, keepdims=True)
  return y if where is None else jnp.where(where, y, -jnp.inf)


def cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  reduction="mean"):
  """Softmax cross-entropy with integer labels over the last axis of ``logits``.

  Per row: -sum_j q_j log p_j with q = (1 - label_smoothing)·onehot(label) +
  label_smoothing / V (optax.smooth_labels), plus z_loss·lse². Rows whose label is
  ``ignore_index`` give 0 and are left out of the mean; other labels outside [0, V)
  give NaN. Computed in the dtype of ``logits``.
  """
  n_classes = logits.shape[-1]
  lse = logsumexp(logits, axis=-1)
  active = labels != ignore_index
  in_range = (labels >= 0) & (labels < n_classes)
  safe = jnp.where(in_range, labels, 0)
  label_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
  loss = lse - (1 - label_smoothing) * label_logit
  if label_smoothing:
    loss = loss - label_smoothing / n_classes * jnp.sum(logits, axis=-1)
  if z_loss:
    loss = loss + z_loss * lse**2
  loss = jnp.where(active, jnp.where(in_range, loss, jnp.nan), 0)
  if reduction == "none":
    return loss
  if reduction == "sum":
    return jnp.sum(loss)
  return jnp.sum(loss) / jnp.maximum(jnp.sum(active), 1)
