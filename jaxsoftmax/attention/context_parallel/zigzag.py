"""The zigzag layout of a sequence sharded over P devices (`ring.ring_attention`'s
``layout="zigzag"``): the sequence cut into 2P chunks, device d holding chunks d and
2P-1-d, so that under a causal mask every device does the same work."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["zigzag_permute", "zigzag_unpermute"]


def _zigzag_order(num_shards: int) -> np.ndarray:
  """Chunk order of the zigzag layout: 0, 2P-1, 1, 2P-2, ..."""
  return np.array([c for d in range(num_shards) for c in (d, 2 * num_shards - 1 - d)])


def _check_zigzag(x, num_shards, axis, op):
  if not (isinstance(num_shards, int) and num_shards >= 1):
    raise ValueError(f"{op}: num_shards must be a positive int, got {num_shards!r}")
  length = x.shape[axis]
  if length % (2 * num_shards):
    raise ValueError(f"{op}: the length {length} of axis {axis} must be a multiple of "
                     f"2 * num_shards = {2 * num_shards}")


def _reorder_chunks(x, order: np.ndarray, axis: int):
  chunks = jnp.split(x, len(order), axis=axis)
  return jnp.concatenate([chunks[c] for c in order], axis=axis)


def zigzag_permute(x, num_shards: int, axis: int = 1):
  """Puts a sequence axis in the zigzag order of `ring_attention(layout="zigzag")`: cut
  into 2·num_shards chunks, device d's shard becomes chunks d and 2·num_shards-1-d. Apply
  it to the tokens (and to positions, for RoPE) before sharding the axis."""
  x = jnp.asarray(x)
  _check_zigzag(x, num_shards, axis, "zigzag_permute")
  return _reorder_chunks(x, _zigzag_order(num_shards), axis)


def zigzag_unpermute(x, num_shards: int, axis: int = 1):
  """The inverse of `zigzag_permute`: back to the natural order of the sequence."""
  x = jnp.asarray(x)
  _check_zigzag(x, num_shards, axis, "zigzag_unpermute")
  return _reorder_chunks(x, np.argsort(_zigzag_order(num_shards)), axis)
