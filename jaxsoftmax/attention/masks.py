"""Which (query, key) pairs attention may use, per element and per block (every backend).

Query i may attend to key j when all the masks in use allow it:

    causal          j <= i                      (top-left aligned when T != S, as jax.nn)
    local window    i - left <= j <= i + right
    key lengths     j < key_value_seq_lengths[b]
    segments        segment_ids_q[b, i] == segment_ids_kv[b, j]
    mask array      mask[b, n, i, j] (broadcast), read by tiles in the Triton kernels
    padding         j < S                       (the last key block may run past S)

Query rows at or past query_seq_lengths[b] use no key at all: their output is 0 and their
lse -inf, which the kernels get by skipping their blocks and zeroing those rows at the end.

The kernels walk the key blocks of a query block in three ranges (FlashAttention-2, and
the Triton tutorial's split of the causal loop): blocks that no mask can reach run
without any element mask; only the boundary blocks before and after them compute one,
and blocks that are entirely masked are not visited at all.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def check_window(local_window_size, op: str) -> tuple[int, int] | None:
  """``local_window_size`` (None, w, or (left, right)) as a (left, right) pair, or None;
  a ValueError naming the argument for anything else."""
  if local_window_size is None:
    return None
  if isinstance(local_window_size, int):
    local_window_size = (local_window_size, local_window_size)
  if (not isinstance(local_window_size, Sequence) or len(local_window_size) != 2
      or not all(isinstance(w, int) and w >= 0 for w in local_window_size)):
    raise ValueError(f"{op}: local_window_size must be an int >= 0 or a (left, right) "
                     f"pair of them, got {local_window_size!r}")
  return tuple(local_window_size)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of the masks (the lengths and segment ids are arrays)."""

  q_len: int  # T
  kv_len: int  # S
  is_causal: bool = False
  window_left: int | None = None
  window_right: int | None = None
  has_segments: bool = False
  has_mask: bool = False  # a mask array (B, N, T, S) or broadcast: every block reads it

  @property
  def one_sided(self) -> bool:
    """Whether every allowed key sits at or before its query (k <= q): causal masking,
    or a window with no right side."""
    return self.is_causal or (self.window_right is not None and self.window_right <= 0)


# Block arithmetic on non-negative int32 scalars, where truncation is the floor. The
# operands are made int32 first: under jax_enable_x64, Python ints and lengths promote
# the indices to int64, which lax.div would refuse to divide by an int32.
def _floor_div(a, b: int):
  return lax.div(lax.convert_element_type(a, jnp.int32), jnp.int32(b))


def cdiv(a, b: int):
  """ceil(a / b) for a traced a >= 0; the kernels' int32 stand-in for pl.cdiv."""
  return _floor_div(lax.convert_element_type(a, jnp.int32) + jnp.int32(b - 1), b)


def key_block_ranges(spec: MaskSpec, q0, block_q: int, block_k: int, kv_length, q_length):
  """(lo, full_lo, full_hi, hi): key blocks [lo, hi) may hold allowed keys for the queries
  [q0, q0 + block_q); those in [full_lo, full_hi) need no element mask.

  ``q0`` and the batch row's lengths (or None) may be traced int32 scalars.
  """
  n_blocks = cdiv(spec.kv_len, block_k)
  q_last = q0 + block_q - 1
  lo = jnp.int32(0)
  hi = jnp.int32(n_blocks)
  # Blocks entirely inside every mask: the last key must be allowed for the first query
  # and the first key for the last query.
  full_lo = jnp.int32(0)
  full_hi = jnp.int32(spec.kv_len // block_k)  # a partial last block is masked
  if spec.is_causal:
    hi = jnp.minimum(hi, cdiv(q_last + 1, block_k))
    full_hi = jnp.minimum(full_hi, _floor_div(q0 + 1, block_k))
  if spec.window_right is not None:
    hi = jnp.minimum(hi, cdiv(q_last + spec.window_right + 1, block_k))
    full_hi = jnp.minimum(full_hi, _floor_div(q0 + spec.window_right + 1, block_k))
  if spec.window_left is not None:
    lo = jnp.maximum(lo, _floor_div(jnp.maximum(q0 - spec.window_left, 0), block_k))
    full_lo = jnp.maximum(full_lo, cdiv(jnp.maximum(q_last - spec.window_left, 0), block_k))
  if kv_length is not None:
    hi = jnp.minimum(hi, cdiv(kv_length, block_k))
    full_hi = jnp.minimum(full_hi, _floor_div(kv_length, block_k))
  if spec.has_segments or spec.has_mask:
    full_hi = full_lo  # every block compares segment ids or reads the mask
  if q_length is not None:  # queries past the length use no key
    hi = jnp.where(q0 < q_length, hi, lo)
  hi = jnp.maximum(hi, lo)
  full_lo = jnp.clip(full_lo, lo, hi)
  full_hi = jnp.clip(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def query_block_ranges(spec: MaskSpec, k0, block_q: int, block_k: int, kv_length,
                       q_length, n_q_blocks: int):
  """(lo, full_lo, full_hi, hi): query blocks [lo, hi) may attend to some key of
  [k0, k0 + block_k); the dK/dV kernel. Those in [full_lo, full_hi) need no element mask.

  Lengths need no element mask there: queries past their length have lse = -inf, so
  their probabilities are 0, and the kernel zeroes the gradients of keys past theirs.
  """
  k_last = k0 + block_k - 1
  lo = jnp.int32(0)
  hi = jnp.int32(n_q_blocks)
  full_lo = jnp.int32(0)
  full_hi = jnp.int32(n_q_blocks)
  if spec.is_causal:  # queries i >= j
    lo = jnp.maximum(lo, _floor_div(k0, block_q))
    full_lo = jnp.maximum(full_lo, cdiv(k_last, block_q))
  if spec.window_left is not None:  # i <= j + left
    hi = jnp.minimum(hi, cdiv(k_last + spec.window_left + 1, block_q))
    full_hi = jnp.minimum(full_hi, _floor_div(k0 + spec.window_left + 1, block_q))
  if spec.window_right is not None:  # i >= j - right
    lo = jnp.maximum(lo, _floor_div(jnp.maximum(k0 - spec.window_right, 0), block_q))
    full_lo = jnp.maximum(full_lo, cdiv(jnp.maximum(k_last - spec.window_right, 0), block_q))
  if spec.has_segments or spec.has_mask:
    full_hi = full_lo  # every block compares segment ids or reads the mask
  if kv_length is not None:  # the whole key block past the length: nothing to do
    hi = jnp.where(k0 < kv_length, hi, lo)
  if q_length is not None:
    hi = jnp.minimum(hi, cdiv(q_length, block_q))
  hi = jnp.maximum(hi, lo)
  full_lo = jnp.clip(full_lo, lo, hi)
  full_hi = jnp.clip(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def narrow_ranges(ranges, span):
  """``ranges`` ((lo, full_lo, full_hi, hi), of `key_block_ranges` or
  `query_block_ranges`) within ``span``: None, or (first, end), the blocks [first, end)
  a mask array leaves some allowed pair in (`triton.tiling.live_block_spans`)."""
  if span is None:
    return ranges
  lo, full_lo, full_hi, hi = ranges
  first, end = span
  lo = jnp.maximum(lo, first)
  hi = jnp.maximum(jnp.minimum(hi, end), lo)
  full_lo = jnp.clip(full_lo, lo, hi)
  return lo, full_lo, jnp.clip(full_hi, full_lo, hi), hi


def element_mask(spec: MaskSpec, q_idx: jax.Array, k_idx: jax.Array, kv_length,
                 q_segments, k_segments) -> jax.Array:
  """The mask of allowed (query, key) pairs, broadcast from q_idx and k_idx (and the
  segment ids, shaped like them): (block_q, 1) and (1, block_k), or transposed."""
  allowed = k_idx < spec.kv_len
  if spec.is_causal:
    allowed = allowed & (k_idx <= q_idx)
  if spec.window_left is not None:
    allowed = allowed & (q_idx - spec.window_left <= k_idx)
  if spec.window_right is not None:
    allowed = allowed & (k_idx <= q_idx + spec.window_right)
  if kv_length is not None:
    allowed = allowed & (k_idx < kv_length)
  if q_segments is not None:
    allowed = allowed & (q_segments == k_segments)
  return allowed


def walk_block_ranges(ranges, body, carry, after_interior=None):
  """Runs ``body(j, carry, masked=...)`` over the blocks j of the ranges (lo, full_lo,
  full_hi, hi): with element masks on [lo, full_lo) and [full_hi, hi), without on the
  interior [full_lo, full_hi); then ``after_interior(carry)``, where given, between the
  interior and the blocks after it."""
  lo, full_lo, full_hi, hi = ranges
  carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
  if after_interior is not None:
    carry = after_interior(carry)
  return lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)
