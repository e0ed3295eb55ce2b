"""Attention's reference: jax.nn.dot_product_attention's XLA path, with our masks.

Pure jnp in the dtype of the inputs: the truth every kernel is checked against (the
tests evaluate it in float64, and in the input dtype for the error that dtype allows:
the 2x rule, docs/testing.md and `tests/tolerance.py`), and the op's XLA path (float64,
empty inputs, and by default off a GPU). It follows jax.nn / optax semantics, including
`where` and -inf handling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["attention_logits", "attention_mask", "dot_product_attention"]


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


def attention_logits(query, key, bias=None, mask=None, *, scale=None, is_causal=False,
                     query_seq_lengths=None, key_value_seq_lengths=None,
                     local_window_size=None, logits_soft_cap=None, q_segments=None,
                     kv_segments=None, alibi_slopes=None):
  """The logits attention normalizes, (B, K, N // K, T, S) with the query heads grouped
  by their key head: the scaled products, soft-capped, plus the bias and ALiBi terms,
  -inf where the masks allow no attention. float32 (float64 for float64 inputs)."""
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
  if alibi_slopes is not None:
    distance = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(S)[None, :]).astype(acc)
    logits = logits - (jnp.asarray(alibi_slopes).astype(acc).reshape(1, K, N // K, 1, 1)
                       * distance[None, None, None])
  return jnp.where(allowed, logits, -jnp.inf)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          logits_soft_cap=None, q_segments=None, kv_segments=None,
                          sinks=None, alibi_slopes=None):
  """Attention in layout B T N H (K/V heads dividing N; the values' head dim may differ
  from the queries' and keys'), returning (out, lse).

  As jax.nn.dot_product_attention's XLA path: logits in float32 (float64 for float64
  inputs), softmax in float32, probabilities cast to the value dtype for the second
  product. One difference, by design: a query row with no allowed key (masked entirely)
  gives out = 0 and lse = -inf with zero gradients, where jax.nn averages the values.
  lse is float32, shape (B, T, N).

  ``sinks``: optional logits broadcastable to (B, N), one per query head (attention
  sinks, docs/math.md): each joins its rows' softmax without a value, so l gains
  exp(sink - m) and every probability shrinks; lse includes it. A row with no allowed
  key then gives out = 0 and lse = its sink.

  ``alibi_slopes``: optional (N,) slopes: logit (i, j) gains -slope · |i - j| (ALiBi,
  positions aligned at the first key, as the causal mask), added with the bias.
  """
  B, T, N, _ = query.shape
  K = key.shape[2]
  acc = jnp.promote_types(query.dtype, jnp.float32)
  logits = attention_logits(
      query, key, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
      q_segments=q_segments, kv_segments=kv_segments, alibi_slopes=alibi_slopes)
  m = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
  if sinks is not None:  # (B, K, G, 1, 1), the logits' dtype
    sinks = jnp.broadcast_to(sinks, (B, N)).reshape(B, K, N // K, 1, 1).astype(acc)
    m = jnp.maximum(m, sinks)
  m = jax.lax.stop_gradient(m)
  m = jnp.where(jnp.isfinite(m), m, 0)
  p = jnp.exp(logits - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  if sinks is not None:
    l = l + jnp.exp(sinks - m)
  some = l != 0  # l = 0: no allowed key; NaN (from a NaN input) stays NaN
  probs = jnp.where(some, p / jnp.where(some, l, 1), 0)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(value.dtype), value,
                   preferred_element_type=acc, precision=jax.lax.Precision.HIGHEST)
  lse = jnp.where(some, m + jnp.log(jnp.where(some, l, 1)), -jnp.inf)[..., 0]
  lse = lse.reshape(B, N, T).transpose(0, 2, 1).astype(jnp.float32)
  return out.reshape(B, T, N, value.shape[3]).astype(query.dtype), lse
