"""Writing new tokens' keys or values into a KV cache, contiguous or paged, as
`decode_attention` reads it."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["update_kv_cache"]


def update_kv_cache(cache, new, lengths, *, block_table=None):
  """``cache`` with the T new tokens of each sequence written at positions
  ``lengths[b] - T`` to ``lengths[b] - 1`` (``lengths`` counting them, as
  `decode_attention` takes it).

  Args:
    cache: contiguous (B, S, K, H), or a page pool (num_pages, page_size, K, H) with
      ``block_table``.
    new: (B, T, K, H), cast to the cache's dtype.
    lengths: (B,) integers, each at least T (a sequence of length 0 writes nothing).
    block_table: (B, max_pages) int32 for a paged cache.

  Returns:
    The updated cache. Under ``jax.jit`` with the cache donated (``donate_argnums``), XLA
    writes it in place; positions outside the cache (or its pool) are dropped, never
    written elsewhere.
  """
  new = jnp.asarray(new).astype(cache.dtype)
  B, T = new.shape[:2]
  lengths = jnp.asarray(lengths, jnp.int32)
  pos = lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :]  # (B, T)
  keep = (lengths[:, None] > 0) & (pos >= 0)
  if block_table is None:
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    pos = jnp.where(keep, pos, cache.shape[1])  # out of range: dropped
    return cache.at[rows, pos].set(new, mode="drop")
  page_size, max_pages = cache.shape[1], block_table.shape[1]
  page_index = pos // page_size
  page = jnp.take_along_axis(block_table, jnp.clip(page_index, 0, max_pages - 1), axis=1)
  page = jnp.where(keep & (page_index < max_pages), page, cache.shape[0])
  return cache.at[page, pos % page_size].set(new, mode="drop")
