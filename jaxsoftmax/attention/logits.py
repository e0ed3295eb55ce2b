"""Logits and their exponentials inside the attention kernels, for every backend.

The kernels keep x = q kᵀ unscaled (or soft-capped: x = cap · tanh(q kᵀ · scale / cap)) and
fold the logits' scale into the base-2 exponent, so that a probability costs one fused
multiply-add and the hardware ex2 (FlashAttention-2's and the Triton tutorial's trick):

    logits = x · factor;  exp(logits - lse) = 2^(x · c - lse · log2 e),  c = factor · log2 e

A row statistic m (a running max of x) stays in x's units, which is valid because the
factor is positive. For float32 inputs the exponent is formed as (x - m) · c instead: the
fused form rounds x · c relative to |x| (about 1e-5 absolute at logits of 100), far below
16-bit inputs' own rounding but not below float32's.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxsoftmax._core.state import LOG2E


@dataclasses.dataclass(frozen=True)
class Logits:
  """How one kernel forms logits: ``scale``, optional soft ``cap``, and whether the
  exponent may be fused (16-bit inputs)."""

  scale: float
  softcap: float | None
  fused: bool

  @property
  def factor(self) -> float:
    """logits = x · factor."""
    return 1.0 if self.softcap is not None else self.scale

  def cap(self, qk):
    """x for the float32 products qk = q kᵀ of a tile, and tanh(qk · scale / cap) (for
    the backward; None without a soft cap)."""
    if self.softcap is None:
      return qk, None
    t = jnp.tanh(qk * (self.scale / self.softcap))
    return self.softcap * t, t

  def exponent(self, x, m, broadcast=lambda m: m):
    """log2 of exp(logits - m · factor), for m a running max of x; ``broadcast`` takes
    m (and m · c, computed before it, once per row) to x's shape."""
    c = self.factor * LOG2E
    return x * c - broadcast(m * c) if self.fused else (x - broadcast(m)) * c

  def exponent_from_stats(self, x, m, log2_l):
    """log2 of exp(logits - lse), for lse given as the forward's m (in x's units) and
    log2(l), both broadcast to x."""
    c = self.factor * LOG2E
    return x * c - (m * c + log2_l) if self.fused else (x - m) * c - log2_l

  def lse(self, m, log2_l):
    """lse = m · factor + log(l) in natural units, from a finite m."""
    return m * self.factor + log2_l / LOG2E


def check_per_head(x, N: int, name: str, each: str, op: str):
  """None, or ``x`` (the argument ``name``: sinks, ALiBi slopes) as an array after
  checking it is floating of shape (N,), one ``each`` per query head; a ValueError
  naming the argument otherwise."""
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.shape != (N,) or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{op}: {name} must be a floating array of shape (N,) = ({N},), one "
                     f"{each} per query head, got {x.dtype} {x.shape}")
  return x


def join_sink(logits: Logits, m, l, sink, exp2):
  """A row's online-softmax state (m, l) joined with its head's sink logit ``sink`` (in
  the logits' units; docs/math.md, "Attention sinks"), one more key whose value is 0:
  (m', l', alpha), the accumulator to be scaled by alpha. Every forward kernel's
  epilogue runs it, so the output leaves the kernel normalized by the sink too and the
  saved (m', log2 l') are the statistics the backward reads. An empty row (m = -inf,
  l = 0) gets m' = the sink in x's units and l' = 1; a sink of -inf changes nothing."""
  sink_x = sink * (1 / logits.factor)
  m_new = jnp.maximum(m, sink_x)
  shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = exp2(logits.exponent(m, shift))
  return m_new, l * alpha + exp2(logits.exponent(sink_x, shift)), alpha


def sink_tangent(o, p_sink, sinks_dot):
  """The output's tangent (float32) for the sinks' tangent ``sinks_dot`` (B, N):
  dO/dz = -O · p_sink, from the float32 O (B, T, N, H) and each row's probability of its
  sink p_sink (B, T, N) (`sink_probability`). Plain jnp, linear in ``sinks_dot``: JAX
  transposes it into dz = -Σ over rows of p_sink · rowsum(dO ∘ O)."""
  return -o * (p_sink * sinks_dot.astype(jnp.float32)[:, None, :])[..., None]


def sink_probability(m, log2_l, sinks, *, scale: float, softcap: float | None):
  """Each row's probability of its sink, (B, T, N) float32, from a forward's row
  statistics (m, log2 l) (B, N, T), which include the sinks (B, N): the sink's term of
  l over l, as `join_sink` added it. Not exp(z - lse): lse rounds at its own scale
  (several units), which moved every row's p_sink the same way, and dz sums them
  (docs/testing.md)."""
  logits = Logits(scale, softcap, fused=False)
  sink_x = (sinks.astype(jnp.float32) * (1 / logits.factor))[:, :, None]
  empty = m == -jnp.inf  # no key and a sink of -inf
  p_sink = jnp.where(empty, 0.0,
                     jnp.exp2(logits.exponent(sink_x, jnp.where(empty, 0.0, m)) - log2_l))
  return jnp.transpose(p_sink, (0, 2, 1))


def sink_probability_from_lse(lse, sinks):
  """`sink_probability` from the rows' log-sum-exp (B, T, N), where the statistics of
  one forward are not at hand (context parallelism's merged rows)."""
  return jnp.where(lse == -jnp.inf, 0.0, jnp.exp(sinks.astype(jnp.float32)[:, None, :] - lse))


def lse(m, log2_l, *, scale: float, softcap: float | None):
  """The natural log-sum-exp of the logits from a forward's row statistics (m, log2 l);
  -inf for rows with no allowed key."""
  logits = Logits(scale, softcap, fused=False)
  return jnp.where(m == -jnp.inf, -jnp.inf, logits.lse(m, log2_l))


def row_delta(o, do):
  """delta = rowsum(dO ∘ O), (B, N, T) float32, for o and do (B, T, N, H): the term the
  backward subtracts from dP (docs/math.md, "Attention")."""
  return jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32), do.astype(jnp.float32))


def score_grad(p, dp, delta, tanh):
  """dS = P ∘ (dP - delta), times 1 - tanh² under a soft cap (``tanh`` from
  `Logits.cap`, else None)."""
  return cap_grad(p * (dp - delta), tanh)


def cap_grad(ds, tanh):
  """The gradient of the scores before the soft cap from ``ds``, the logits' (which is
  also a bias's: it is added after the cap): times 1 - tanh², or ds without a cap."""
  return ds if tanh is None else ds * (1 - tanh * tanh)


def score_grad_terms(ds, dtype) -> list:
  """dS as tensor-core operands of ``dtype``: rounded to it, and in float16 also the
  rounding remainder ds - f16(ds) as a second term. float16 keeps 11 bits, on dS values
  as large as |dP - delta| (several units): on the H200 that rounding alone put dq at
  2.04x a float16 reference's error (T=1, S=77); the remainder gives dS about float32's
  accuracy for one more matrix product. bfloat16's reference rounds coarsely enough that
  one term suffices."""
  high = ds.astype(dtype)
  if score_grad_term_count(dtype) == 1:
    return [high]
  return [high, (ds - high.astype(jnp.float32)).astype(dtype)]


def score_grad_term_count(dtype) -> int:
  """How many operands `score_grad_terms` makes of dS in ``dtype``."""
  return 2 if jnp.dtype(dtype) == jnp.float16 else 1
