"""The math every kernel of the linear cross-entropy shares: the logits after the soft
cap, their probabilities from the forward's row state, and their gradient ds (the
formulas of `jaxsoftmax.linear_cross_entropy.api`), with ds as the tensor cores'
operands in the inputs' dtype."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxsoftmax._core.state import LOG2E, reduce_states, safe_shift
from jaxsoftmax.linear_cross_entropy.tiling import Dims

__all__ = ["Options", "Rows", "LOG2E", "F16_TOP", "capped", "merged_state", "probabilities",
           "p_coefficient", "logit_gradient", "operand_terms", "power_of_two_scale",
           "scaled_terms", "sum_products"]


@dataclasses.dataclass(frozen=True)
class Options:
  label_smoothing: float
  z_loss: float
  softcap: float | None
  has_bias: bool
  interpret: bool

def capped(z, options: Options):
  """(s, ds/dz or None): the logits s after the soft cap, s = c·tanh(z / c)."""
  if options.softcap is None:
    return z, None
  t = jnp.tanh(z / options.softcap)
  return options.softcap * t, 1.0 - t * t

def merged_state(m, l):
  """The ranges' states (m, l), stacked on axis 0, merged: (safe_shift(m), log l)."""
  m, l = reduce_states(m, l, axis=0)
  return safe_shift(m), jnp.log(l)

class Rows(NamedTuple):
  """The backward's values of each row: its label; the forward's softmax state as its
  shift m (the finite row maximum, `state.safe_shift`) and log l, so that p =
  exp((s - m) - log l) stays exact in float32 where s is near m (through an lse rounded
  to float32, p would be off by up to half its ulp: 5e-4 at |lse| ~ 1e4); and the
  cotangents g of the loss and g_lse of the returned lse."""

  labels: jax.Array
  m: jax.Array
  log_l: jax.Array
  g: jax.Array
  g_lse: jax.Array

  @property
  def lse(self):
    return self.m + self.log_l

def probabilities(s, rows: Rows, exp):
  """p = exp((s - m) - log l) of a block of logits s (rows x columns)."""
  return exp((s - rows.m[:, None]) - rows.log_l[:, None])

def p_coefficient(g, g_lse, lse, z_loss: float):
  """The factor of p in ds, g·(1 + 2ζ·lse) + g_lse; without a z-loss g + g_lse, so that
  an infinite lse (a +inf logit) does not make 0·inf = NaN of every ds in its row."""
  return (g * (1 + 2 * z_loss * lse) if z_loss else g) + g_lse

def logit_gradient(p, dsdz, cols, col_ok, rows: Rows, dims: Dims, options: Options):
  """ds of a block of logits (see the module docstring) from their probabilities p (0
  where masked), ds/dz (None without a soft cap), column indices and which of them lie
  in the vocabulary (None: all), for the `Rows` of its rows."""
  labels, g = rows.labels, rows.g
  a = options.label_smoothing
  ds = p_coefficient(g, rows.g_lse, rows.lse, options.z_loss)[:, None] * p
  ds = ds - jnp.where(cols[None, :] == labels[:, None], (g * (1 - a))[:, None], 0.0)
  if a:
    smoothing = (g * (a / dims.V))[:, None]
    ds = ds - (smoothing if col_ok is None else jnp.where(col_ok[None, :], smoothing, 0.0))
  return ds if dsdz is None else ds * dsdz

def operand_terms(ds, dtype):
  """ds as the tensor cores' operands: ds rounded to the inputs' dtype, and in float16
  also the rounding remainder as a second term. float16's 11 bits on ds put dhidden at
  2.5x a float16 reference's error (which keeps ds in float32); the remainder brings it
  to float32 accuracy for one more product, as the Triton attention backward does for
  dS. bfloat16 takes one term: it keeps dhidden within the 2x rule on the tests' shapes
  and the H200 runs', but not everywhere a small H leaves few products to average the
  rounding (3.3x a bfloat16 reference's error at H = 64, soft cap 4, 340 rows); a
  second term would cost one more product a chunk."""
  high = ds.astype(dtype)
  if dtype != jnp.float16:
    return (high,)
  return high, (ds - high.astype(jnp.float32)).astype(dtype)

# float16 ds is scaled by a power of two that brings its largest magnitude to about
# 2^F16_TOP: a mean over many rows makes ds as small as 1e-8 (g = 1/rows times
# probabilities over a large vocabulary), below float16's smallest normal number (6e-5),
# where its rounding keeps no digits (on the H200: dhidden at 32x a float16 reference's
# error, 256 rows, V = 256000). A power of two rescales exactly, and 2^14 keeps the
# float16 operands below their largest value (65504). bfloat16 has float32's exponent
# range and needs no scale.
F16_TOP = 14

def power_of_two_scale(largest, top: int):
  """2^k with largest · 2^k in (2^(top - 1), 2^top], or 1 for a largest of 0 or NaN."""
  ok = jnp.isfinite(largest) & (largest > 0)
  return jnp.exp2(jnp.where(ok, top - jnp.ceil(jnp.log2(jnp.where(ok, largest, 1.0))), 0.0))

def scaled_terms(ds, dtype):
  """(terms, unscale): `operand_terms` of ds, scaled in float16 (see F16_TOP), and
  the factor that takes the products back."""
  if dtype != jnp.float16:
    return operand_terms(ds, dtype), 1.0
  scale = power_of_two_scale(jnp.max(jnp.abs(ds)), F16_TOP)
  return operand_terms(ds * scale, dtype), 1.0 / scale

def sum_products(terms, product):
  """Σ product(term) over the operand terms of ds."""
  out = product(terms[0])
  for term in terms[1:]:
    out = out + product(term)
  return out
