"""The linear cross-entropy's backward, for every backend: the vocabulary in chunks, each
chunk's logits recomputed by XLA's products (cuBLAS on a GPU) or its ds formed by the
backend's own kernel (`call.LinearCrossEntropyBackend.chunk_ds`: the Hopper one for
bfloat16)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax._core.state import merge_states, safe_shift
from jaxsoftmax.linear_cross_entropy.call import ChunkDs
from jaxsoftmax.linear_cross_entropy.logits import (Options, Rows, capped, logit_gradient,
                                                    probabilities, scaled_terms,
                                                    sum_products)
from jaxsoftmax.linear_cross_entropy.tiling import Dims

__all__ = ["backward", "chunk_states", "xla_dot"]


def _logit_grad_chunk(z, start, rows: Rows, p_rows: Rows, dims: Dims, options: Options):
  """ds (rows, chunk) in float32 for the logits z = x W + b of the columns
  [start, start + chunk), with p from the state of ``p_rows`` (`_own_state`) and the
  rest from ``rows``."""
  s, dsdz = capped(z, options)
  cols = start + jnp.arange(z.shape[1], dtype=jnp.int32)
  return logit_gradient(probabilities(s, p_rows, jnp.exp), dsdz, cols, None, rows, dims,
                        options)


def _starts(c, dims: Dims):
  """The first column of chunk c: the last chunk ends at V, overlapping the one before
  where V is not a multiple of the chunk."""
  return jnp.minimum(c * dims.chunk, dims.V - dims.chunk)


def _own_columns(c, start, dims: Dims):
  """(1, chunk) bool: the columns of chunk c (starting at ``start``) that the chunk before
  does not hold, or None where V is a multiple of the chunk (no overlap)."""
  if dims.V % dims.chunk == 0:
    return None
  return (start + jnp.arange(dims.chunk, dtype=jnp.int32) >= c * dims.chunk)[None, :]


def _chunk_logits(x, w_c, b, start, dims: Dims, dot):
  """z = x W + b (float32) of the columns [start, start + chunk), W's being ``w_c``."""
  z = dot(x, w_c)
  if b is not None:
    z = z + lax.dynamic_slice_in_dim(b, start, dims.chunk).astype(jnp.float32)[None, :]
  return z


def chunk_states(x, w, b, dims: Dims, options: Options, dot, labels=None,
                 with_total: bool = False):
  """Per row, float32 (R,): the softmax state (m, l) of the logits s that XLA's products
  give, one vocabulary chunk at a time (the rule of `state.merge_states`), and with
  ``labels`` also the label's logit s_y and, with ``with_total``, Σ_j s_j (else 0). Only a
  rows x chunk block of logits is ever in memory."""
  n_chunks = pl.cdiv(dims.V, dims.chunk)

  def step(carry, c):
    m, l, label, total = carry
    start = _starts(c, dims)
    w_c = lax.dynamic_slice_in_dim(w, start, dims.chunk, axis=1)
    s = capped(_chunk_logits(x, w_c, b, start, dims, dot), options)[0]
    own = _own_columns(c, start, dims)  # the overlapped columns count once
    if labels is not None:
      cols = start + jnp.arange(dims.chunk, dtype=jnp.int32)
      is_label = cols[None, :] == labels[:, None]
      is_label = is_label if own is None else is_label & own
      label = label + jnp.sum(jnp.where(is_label, s, 0.0), axis=1)
    if with_total:
      total = total + jnp.sum(s if own is None else jnp.where(own, s, 0.0), axis=1)
    if own is not None:
      s = jnp.where(own, s, -jnp.inf)
    m_c = jnp.max(s, axis=1)
    l_c = jnp.sum(jnp.exp(s - safe_shift(m_c)[:, None]), axis=1)
    return (*merge_states(m, l, m_c, l_c), label, total), None

  zeros = jnp.zeros((dims.R,), jnp.float32)
  init = (jnp.full((dims.R,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
  init = pallas.vary_over(init, pallas.varying_axes(x, w, b, labels))
  (m, l, label, total), _ = lax.scan(step, init, jnp.arange(n_chunks, dtype=jnp.int32))
  return m, l, label, total


def _own_state(x, w, b, rows: Rows, dims: Dims, options: Options, dot) -> Rows:
  """``rows`` with the softmax state (m, log l) of the logits the backward's products
  give, one more pass over the chunks. XLA's float32 products round otherwise than the
  forward kernel's, so p from the forward's state would sum to 1 over the backward's
  logits only up to that difference, which cost float32 dhidden 2-4x a float32
  reference's error (whose softmax is normalized by its own sum; docs/numerics.md).
  16-bit inputs do not need it: the difference is far below their ds's rounding, and
  a forward from the same products (`xla_chunks`) has this state already."""
  m, l = chunk_states(x, w, b, dims, options, dot)[:2]
  return rows._replace(m=safe_shift(m), log_l=jnp.log(l))


def xla_dot(dtype):
  """XLA's product with float32 accumulation, at full float32 precision for float32
  operands (by default XLA rounds them to TF32 on the tensor cores)."""
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  return functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)


def backward(x, w, b, rows: Rows, dims: Dims, options: Options, *,
             chunk_ds: ChunkDs | None = None, state_from_xla: bool = False):
  """(dx float32, dw in w's dtype, db float32 or None) over vocabulary chunks, each
  chunk's ds from ``chunk_ds`` (already in the products' dtype) or, with None, from
  XLA's float32 logits. The last chunk ends at V; where V is not a multiple of the chunk
  it overlaps the one before, whose columns it leaves out of dx and rewrites, with the
  same values, in dw and db.

  Its logits are XLA's products, not the forward kernel's: for float32 inputs the
  probabilities come from their own softmax state (`_own_state`); their lse, in ds's
  coefficients, stays the forward's. ``state_from_xla``: the forward's state came from
  these very products (`xla_chunks`), so float32 needs no state of its own."""
  chunk = dims.chunk
  n_chunks = pl.cdiv(dims.V, chunk)
  dot = xla_dot(x.dtype)
  p_rows = rows
  if chunk_ds is None and x.dtype == jnp.float32 and not state_from_xla:
    p_rows = _own_state(x, w, b, rows, dims, options, dot)
  if chunk_ds is not None:
    operands = lambda ds: ((ds,), 1.0)  # already the products' operand
  else:
    operands = lambda ds: scaled_terms(ds, x.dtype)

  def step(carry, c):
    dx, dw, db = carry
    start = _starts(c, dims)
    w_c = lax.dynamic_slice_in_dim(w, start, chunk, axis=1)
    if chunk_ds is not None:  # ds from the backend's kernel; no float32 logits in memory
      ds = chunk_ds(w_c, start)
    else:
      ds = _logit_grad_chunk(_chunk_logits(x, w_c, b, start, dims, dot), start, rows,
                             p_rows, dims, options)
    terms, unscale = operands(ds)
    dw_c = sum_products(terms, lambda d: dot(x.T, d)) * unscale
    dw = lax.dynamic_update_slice_in_dim(dw, dw_c.astype(dw.dtype), start, axis=1)
    own = _own_columns(c, start, dims)
    if own is not None:  # the last chunk's columns of the chunk before stay out of dx
      terms, unscale = operands(jnp.where(own, ds, 0))
    dx = dx + sum_products(terms, lambda d: dot(d, w_c.T)) * unscale
    if db is not None:
      db = lax.dynamic_update_slice_in_dim(db, ds.sum(axis=0), start, axis=0)
    return (dx, dw, db), None

  init = (jnp.zeros((dims.R, dims.H), jnp.float32), jnp.zeros(w.shape, w.dtype),
          None if b is None else jnp.zeros((dims.V,), jnp.float32))
  # The accumulators vary over the mesh axes their summands do (inside jax.shard_map).
  init = pallas.vary_over(init, pallas.varying_axes(x, w, b, rows))
  (dx, dw, db), _ = lax.scan(step, init, jnp.arange(n_chunks, dtype=jnp.int32))
  return dx, dw, db
