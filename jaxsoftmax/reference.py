"""Pure-jnp references: the truth every kernel is checked against, and the ops' XLA path.

Each function computes in the dtype of its input, so the tests evaluate it twice: in
float64 for the truth, and in the input's own dtype for the error that dtype allows
(the 2x rule: docs/testing.md and `tests/tolerance.py`). They follow
jax.nn / optax semantics, including `where` and -inf handling, and are also the path
jaxsoftmax takes for float64 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoftmax.state import nan_for_inf

__all__ = ["accumulated", "logsumexp", "softmax", "log_softmax", "cross_entropy", "attention_mask",
           "dot_product_attention"]


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


def attention_mask(T: int, S: int, *, is_causal=False, local_window_size=None,
                   query_seq_lengths=None, key_value_seq_lengths=None, q_segments=None,
                   kv_segments=None, batch: int = 1):
  """The (B, 1, T, S) boolean mask of the (query, key) pairs attention may use."""
  q = jnp.arange(T)[None, None, :, None]
  k = jnp.arange(S)[None, None, None, :]
  allowed = jnp.ones((batch, 1, T, S), bool)
  if is_causal:
    allowed = allowed & (k <= q)
  if local_window_size is not None:
    left, right = ((local_window_size, local_window_size)
                   if isinstance(local_window_size, int) else local_window_size)
    allowed = allowed & (q - left <= k) & (k <= q + right)
  if key_value_seq_lengths is not None:
    allowed = allowed & (k < key_value_seq_lengths[:, None, None, None])
  if query_seq_lengths is not None:
    allowed = allowed & (q < query_seq_lengths[:, None, None, None])
  if q_segments is not None:
    allowed = allowed & (q_segments[:, None, :, None] == kv_segments[:, None, None, :])
  return allowed


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          logits_soft_cap=None, q_segments=None, kv_segments=None):
  """Attention in layout B T N H (K/V heads dividing N), returning (out, lse).

  As jax.nn.dot_product_attention's XLA path: logits in float32 (float64 for float64
  inputs), softmax in float32, probabilities cast to the value dtype for the second
  product. One difference, by design: a query row with no allowed key (masked entirely)
  gives out = 0 and lse = -inf with zero gradients, where jax.nn averages the values.
  lse is float32, shape (B, T, N).
  """
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  scale = 1 / np.sqrt(H) if scale is None else scale
  acc = jnp.promote_types(query.dtype, jnp.float32)
  q = query.reshape(B, T, K, N // K, H)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, key, preferred_element_type=acc,
                      precision=jax.lax.Precision.HIGHEST) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  allowed = attention_mask(T, S, is_causal=is_causal, local_window_size=local_window_size,
                           query_seq_lengths=query_seq_lengths,
                           key_value_seq_lengths=key_value_seq_lengths,
                           q_segments=q_segments, kv_segments=kv_segments, batch=B)
  allowed = allowed.reshape(B, 1, 1, T, S)
  if mask is not None:
    allowed = allowed & jnp.broadcast_to(mask, (B, N, T, S)).reshape(B, K, N // K, T, S)
  if bias is not None:
    logits = logits + jnp.broadcast_to(bias, (B, N, T, S)).reshape(
        B, K, N // K, T, S).astype(acc)
  logits = jnp.where(allowed, logits, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf))
  m = jnp.where(jnp.isfinite(m), m, 0)
  p = jnp.exp(logits - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  some = l != 0  # l = 0: no allowed key; NaN (from a NaN input) stays NaN
  probs = jnp.where(some, p / jnp.where(some, l, 1), 0)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(value.dtype), value,
                   preferred_element_type=acc, precision=jax.lax.Precision.HIGHEST)
  lse = jnp.where(some, m + jnp.log(jnp.where(some, l, 1)), -jnp.inf)[..., 0]
  lse = lse.reshape(B, N, T).transpose(0, 2, 1).astype(jnp.float32)
  return out.reshape(B, T, N, H).astype(query.dtype), lse
