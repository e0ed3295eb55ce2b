"""Decode attention's reference: plain jnp over the cache as one array, the truth the
kernels are checked against (in float64 by the tests) and the op's XLA path.

Query t of sequence b (of T new tokens) sits at position p = lengths[b] - T + t and sees
the cache positions s with s <= p (causal among the new tokens, the cache before them
whole), and with a window of w to its left also s >= p - w. Positions at or past
lengths[b] are never read into the result: their keys are masked and their values
zeroed, so garbage or NaN there cannot leak. A sequence of length 0 gives output 0 and
lse -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["contiguous_cache", "decode_attention", "decode_mask"]


def contiguous_cache(cache, block_table):
  """A paged pool (num_pages, page_size, K, H) as (B, max_pages · page_size, K, H): the
  pages of each sequence in its block table's order; without a table, ``cache``."""
  if block_table is None:
    return cache
  pages = jnp.take(cache, jnp.clip(block_table, 0, cache.shape[0] - 1), axis=0)
  B, n, page = pages.shape[:3]
  return pages.reshape(B, n * page, *cache.shape[2:])


def decode_mask(lengths, T: int, S: int, window_left: int | None):
  """(B, T, S) bool: the cache positions each new token sees."""
  pos = lengths[:, None] - T + jnp.arange(T)[None, :]  # (B, T)
  s = jnp.arange(S)[None, None, :]
  allowed = (s <= pos[:, :, None]) & (s < lengths[:, None, None])
  if window_left is not None:
    allowed = allowed & (s >= pos[:, :, None] - window_left)
  return allowed


def decode_attention(query, key, value, lengths, *, block_table=None, scale=None,
                     logits_soft_cap=None, window_left: int | None = None, sinks=None):
  """(out (B, T, N, H) in the query's dtype, lse (B, T, N) float32, float64 for float64
  inputs) of T new tokens per sequence against a contiguous (B, S, K, H) or paged cache.
  ``sinks``: optional (N,) logits, one per query head, joining each row's softmax
  without a value (an empty row then has lse = its sink)."""
  key, value = contiguous_cache(key, block_table), contiguous_cache(value, block_table)
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  scale = 1 / np.sqrt(H) if scale is None else scale
  acc = jnp.promote_types(query.dtype, jnp.float32)
  allowed = decode_mask(lengths, T, S, window_left)  # (B, T, S)
  value = jnp.where((jnp.arange(S)[None, :] < lengths[:, None])[:, :, None, None], value, 0)
  q = query.reshape(B, T, K, N // K, H)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, key, preferred_element_type=acc,
                      precision=jax.lax.Precision.HIGHEST) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)  # an empty cache too
  if sinks is not None:  # (1, K, G, 1, 1)
    sinks = jnp.asarray(sinks).astype(acc).reshape(1, K, N // K, 1, 1)
    m = jnp.maximum(m, sinks)
  m = jnp.where(m == -jnp.inf, 0.0, m)  # a row with no allowed position
  p = jnp.exp(logits - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  if sinks is not None:
    l = l + jnp.exp(sinks - m)
  empty = l == 0  # NaN (a NaN key or query) is not empty: it stays NaN
  p = jnp.where(empty, 0.0, p / jnp.where(empty, 1.0, l))
  out = jnp.einsum("bkgts,bskh->btkgh", p.astype(value.dtype), value,
                   preferred_element_type=acc, precision=jax.lax.Precision.HIGHEST)
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))[..., 0]
  return (out.reshape(B, T, N, H).astype(query.dtype),
          jnp.transpose(lse, (0, 3, 1, 2)).reshape(B, T, N).astype(acc))
