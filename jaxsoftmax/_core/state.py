"""Online-softmax states and their merges (the math of every kernel here; docs/math.md).

A softmax state over a set of values x_i is the pair (m, l): m = max_i x_i and
l = sum_i exp(x_i - m), where a non-finite m is replaced by 0 inside the exp (so the
empty state is m = -inf, l = 0). Two states over disjoint sets merge associatively:

    m = max(m_a, m_b);   l = l_a·exp(m_a - m) + l_b·exp(m_b - m)

and the log-sum-exp of the values is m + log(l) (`state_lse`). Keeping m and l apart,
rather than only their lse, is what lets softmax = exp(x - m) / l and
log_softmax = (x - m) - log(l) keep full float32 accuracy when |x| is large. Partial
attention results (o, lse), each an output normalised over its own keys, merge the same
way:

    lse = log(exp(lse_a) + exp(lse_b));   o = o_a·exp(lse_a - lse) + o_b·exp(lse_b - lse)

These merges are what a split-row kernel does across programs, and what a user does
across devices (e.g. after an all-gather of partial results over a sharded vocabulary or
sequence). The empty state (m = -inf, l = 0; or lse = -inf) is the identity: merging
with it never produces NaN, and merging two empty states gives an empty state with o = 0.
Infinite or NaN values propagate as they would in jax.nn.logsumexp.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["merge_states", "reduce_states", "state_lse", "merge_attention_states", "reduce_lse",
           "merge_moments", "reduce_moments", "nan_for_inf", "LOG2E"]

# log2(e): the kernels take exp(x) as exp2(x · LOG2E), the hardware's ex2 (docs/math.md).
LOG2E = math.log2(math.e)


def safe_shift(m: jax.Array) -> jax.Array:
  """m where it is finite, else 0: the shift to subtract before exp."""
  # Subtracting a non-finite maximum would turn exp(-inf - -inf) into NaN; shift by 0
  # instead, so an empty state stays empty and +inf stays +inf (as jax.nn.logsumexp).
  return jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))


def nan_for_inf(l: jax.Array) -> jax.Array:
  """l, or NaN where it is +inf. l is +inf exactly when the row holds +inf (the shift of a
  non-finite maximum is 0, so exp(inf - 0) enters the sum; finite terms are at most 1).
  Such a row's softmax and log_softmax are NaN throughout, as jax.nn's inf - inf makes
  them (docs/numerics.md); its logsumexp, from l itself, stays +inf. NaN is added, not
  substituted, so that autodiff carries it into the row's gradients too."""
  return l + jnp.where(l == jnp.inf, jnp.nan, 0.0)


def probabilities(x, m, l, where=None) -> jax.Array:
  """p = exp(x - m) / l of each row of x (R, C), float32, from a row state made safe
  (m finite, `safe_shift`): 0 where ``where`` masks and on rows with nothing left."""
  l = l[:, None]
  p = jnp.exp(x.astype(jnp.float32) - m[:, None]) / jnp.where(l > 0, l, 1)
  return p if where is None else jnp.where(where, p, 0.0)


def reduce_states(m, l, axis: int = 0) -> tuple[jax.Array, jax.Array]:
  """Merges the online-softmax states (m, l) stacked along ``axis``; returns (m, l)."""
  m, l = jnp.asarray(m), jnp.asarray(l)
  if m.shape != l.shape:
    raise ValueError(f"reduce_states: m and l must have one shape, got m {m.shape} and "
                     f"l {l.shape}")
  m_all = jnp.max(m, axis=axis)
  shift = jnp.expand_dims(safe_shift(m_all), axis)
  return m_all, jnp.sum(l * jnp.exp(m - shift), axis=axis)


def merge_states(m_a, l_a, m_b, l_b) -> tuple[jax.Array, jax.Array]:
  """Merges two online-softmax states (m, l) elementwise; returns (m, l).

  Args:
    m_a, l_a: running maximum and sum of exp(x - m_a) of the first part.
    m_b, l_b: the same for the second part; all four broadcast together.
  """
  try:
    m_a, l_a, m_b, l_b = jnp.broadcast_arrays(m_a, l_a, m_b, l_b)
  except ValueError:
    shapes = ", ".join(f"{n} {jnp.shape(a)}" for n, a in
                       (("m_a", m_a), ("l_a", l_a), ("m_b", m_b), ("l_b", l_b)))
    raise ValueError(f"merge_states: m_a, l_a, m_b and l_b must broadcast together, got "
                     f"{shapes}") from None
  return reduce_states(jnp.stack([m_a, m_b]), jnp.stack([l_a, l_b]), axis=0)


def state_lse(m, l) -> jax.Array:
  """log-sum-exp of the values a state (m, l) summarizes: -inf for the empty state."""
  return safe_shift(jnp.asarray(m)) + jnp.log(l)


def reduce_lse(lse: jax.Array, axis: int = 0) -> jax.Array:
  """log(sum(exp(lse), axis)) of partial log-sum-exps, safe for empty (-inf) parts."""
  lse = jnp.asarray(lse)
  m = jnp.max(lse, axis=axis)
  shift = safe_shift(m)
  return shift + jnp.log(jnp.sum(jnp.exp(lse - jnp.expand_dims(shift, axis)), axis=axis))


def merge_attention_states(o_a, lse_a, o_b, lse_b) -> tuple[jax.Array, jax.Array]:
  """Merges two partial attention results; returns (o, lse).

  Args:
    o_a: output of the first part, normalised over its keys, shape ``(..., H)``.
    lse_a: its log-sum-exp of scores, float32, shape ``(...)`` = ``o_a.shape[:-1]``.
    o_b, lse_b: the same for the second part.

  Returns:
    ``o`` in the dtype of ``o_a`` (weights applied in float32) and ``lse`` (float32).
    Rows empty in both parts (lse = -inf) get o = 0 and lse = -inf.
  """
  o_a, o_b = jnp.asarray(o_a), jnp.asarray(o_b)
  lse_a = jnp.asarray(lse_a, jnp.float32)
  lse_b = jnp.asarray(lse_b, jnp.float32)
  if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or o_a.shape[:-1] != lse_a.shape:
    raise ValueError(
        "merge_attention_states: o_a, o_b must have one shape (..., H) and lse_a, lse_b "
        f"the shape (...); got o_a {o_a.shape}, o_b {o_b.shape}, lse_a {lse_a.shape}, "
        f"lse_b {lse_b.shape}")
  lse = reduce_lse(jnp.stack([lse_a, lse_b]), axis=0)
  # An empty row has lse = -inf in both parts and in the merge: its weights are 0.
  empty = lse == -jnp.inf
  w_a = jnp.where(empty, 0.0, jnp.exp(lse_a - lse))[..., None]
  w_b = jnp.where(empty, 0.0, jnp.exp(lse_b - lse))[..., None]
  o = w_a * o_a.astype(jnp.float32) + w_b * o_b.astype(jnp.float32)
  return o.astype(o_a.dtype), lse


def merge_moments(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
  """Merges two Welford states (count, mean, M2 = sum of squared deviations) of disjoint
  sets elementwise, both means taken from the same shift (docs/math.md, "Mean and
  variance"); an empty state (n = 0) is the identity."""
  n = n_a + n_b
  delta = mean_b - mean_a
  share = jnp.where(n > 0, n_b / jnp.where(n > 0, n, 1.0), 0.0)
  return n, mean_a + delta * share, m2_a + m2_b + delta * delta * n_a * share


def reduce_moments(n, shift, mean, m2, axis: int = 0):
  """Merges the Welford states stacked along ``axis``, each mean taken from its part's own
  shift (a value near the part's data): returns (n, mean, M2) of the whole. The parts'
  means are first taken from the first part's shift (``shift - shift₀``, nearby values
  whose difference is exact), so that none rounds at the data's magnitude before the
  merge; then the overall mean, and each part's M2 plus its count times its mean's
  squared distance from it."""
  ref = jnp.take(shift, 0, axis=axis)
  mean = (shift - jnp.expand_dims(ref, axis)) + mean
  total = jnp.sum(n, axis=axis)
  mean_all = jnp.sum(n * mean, axis=axis) / jnp.where(total > 0, total, 1.0)
  spread = n * jnp.square(mean - jnp.expand_dims(mean_all, axis))
  return total, ref + mean_all, jnp.sum(m2 + spread, axis=axis)
