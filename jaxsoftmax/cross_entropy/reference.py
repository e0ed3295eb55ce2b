"""Cross-entropy's reference: optax's integer-label softmax cross-entropy with our options.

Pure jnp in the dtype of the inputs: the truth every kernel is checked against (the
tests evaluate it in float64, and in the input dtype for the error that dtype allows:
the 2x rule, docs/testing.md and `tests/tolerance.py`), and the op's XLA path (float64,
empty inputs, and by default off a GPU). It follows jax.nn / optax semantics, including
`where` and -inf handling.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxsoftmax.softmax.reference import _log_l, _log_softmax, _state, log_softmax, logsumexp

__all__ = ["cross_entropy"]


def cross_entropy(logits, labels, *, where=None, ignore_index=-100, label_smoothing=0.0,
                  z_loss=0.0, reduction="mean"):
  """Softmax cross-entropy with integer labels over the last axis of ``logits``.

  Per row: -sum_j q_j log p_j with q = (1 - label_smoothing)·onehot(label) +
  label_smoothing / V (optax.smooth_labels), plus z_loss·lse². Rows whose label is
  ``ignore_index`` give 0 and are left out of the mean; other labels outside [0, V)
  give NaN. ``where`` (the shape of ``logits``; no smoothing with it) leaves logits out
  of the normalizer, as optax: the loss is lse(allowed logits) - logit of the label,
  and a row with no allowed logit gives 0 and counts as ignored. Computed in the dtype
  of ``logits``.
  """
  n_classes = logits.shape[-1]
  active = labels != ignore_index
  if where is not None:  # a row with no logit left counts as ignored
    active = active & jnp.any(where, axis=-1)
  in_range = (labels >= 0) & (labels < n_classes)
  safe = jnp.where(in_range, labels, 0)
  # From the raw l (not log_softmax's NaN for a row holding +inf): a +inf logit gives a
  # loss of +inf, NaN where it is the label's, as optax's lse - label logit does.
  if where is None:
    log_p = _log_softmax(logits, -1, None)
    log_p_label = jnp.take_along_axis(log_p, safe[..., None], axis=-1)[..., 0]
  else:  # log p of the label as log_softmax forms it, also where the label is masked
    m, l = _state(logits, -1, where)
    label_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)
    log_p_label = ((label_logit - m) - _log_l(l, -1, where))[..., 0]
  loss = -(1 - label_smoothing) * log_p_label
  if label_smoothing:
    loss = loss - label_smoothing / n_classes * jnp.sum(log_softmax(logits, axis=-1), axis=-1)
  if z_loss:
    loss = loss + z_loss * logsumexp(logits, axis=-1, where=where)**2
  loss = jnp.where(active, jnp.where(in_range, loss, jnp.nan), 0)
  if reduction == "none":
    return loss
  if reduction == "sum":
    return jnp.sum(loss)
  return jnp.sum(loss) / jnp.maximum(jnp.sum(active), 1)
