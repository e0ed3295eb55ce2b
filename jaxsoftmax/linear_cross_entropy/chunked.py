"""The default backward of the linear cross-entropy: the vocabulary in chunks, each
chunk's logits recomputed by XLA's products (cuBLAS on a GPU) or, for bfloat16 on a
Hopper GPU, its ds formed by one Mosaic GPU kernel (`mosaic_gpu.dlogits`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax.linear_cross_entropy import mosaic_gpu
from jaxsoftmax.linear_cross_entropy.logits import (Options, Rows, capped, logit_gradient,
                                                    p_coefficient, probabilities,
                                                    scaled_terms, sum_products)
from jaxsoftmax.linear_cross_entropy.tiling import Dims

__all__ = ["backward"]


def _logit_grad_chunk(z, start, rows, dims: Dims, options: Options):
  """ds (rows, chunk) in float32 for the logits z = x W + b of the columns
  [start, start + chunk); `triton._logit_grad` for a whole chunk, in XLA."""
  s, dsdz = capped(z, options)
  cols = start + jnp.arange(z.shape[1], dtype=jnp.int32)
  return logit_gradient(probabilities(s, rows, jnp.exp), dsdz, cols, None, rows, dims, options)


def backward(x, w, b, rows: Rows, dims: Dims, options: Options):
  """(dx float32, dw in w's dtype, db float32 or None) over vocabulary chunks. The last
  chunk ends at V; where V is not a multiple of the chunk it overlaps the one before,
  whose columns it leaves out of dx and rewrites, with the same values, in dw and db.

  Its logits are XLA's product, not the forward kernel's: the two round their float32
  sums differently, so p of a row sums to 1 only up to that difference.
  For 16-bit inputs that is far below their own rounding; for float32 inputs it put
  dhidden at 2-3x a float32 reference's error (whose softmax is normalized by its own
  sum), so float32 defaults to the "two_kernels" backward, whose logit tiles are the
  forward's."""
  chunk = dims.chunk
  n_chunks = pl.cdiv(dims.V, chunk)
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
  hopper = dims.tiling.dlogits == "mosaic_gpu"
  if hopper:
    shared = mosaic_gpu.dlogits_inputs(
        x, rows.labels, rows.m, rows.log_l, rows.g,
        p_coefficient(rows.g, rows.g_lse, rows.lse, options.z_loss), V=dims.V,
        label_smoothing=options.label_smoothing)
    operands = lambda ds: ((ds,), 1.0)  # already bfloat16, the products' operand
  else:
    operands = lambda ds: scaled_terms(ds, x.dtype)

  def step(carry, c):
    dx, dw, db = carry
    start = jnp.minimum(c * chunk, dims.V - chunk)
    w_c = lax.dynamic_slice_in_dim(w, start, chunk, axis=1)
    if hopper:  # ds in bfloat16 from one kernel; no float32 logits in memory
      ds = mosaic_gpu.dlogits(shared, w_c, start, tiling=dims.tiling.hopper_tiling,
                              softcap=options.softcap, interpret=options.interpret)[:dims.R]
    else:
      z = dot(x, w_c)
      if b is not None:
        z = z + lax.dynamic_slice_in_dim(b, start, chunk).astype(jnp.float32)[None, :]
      ds = _logit_grad_chunk(z, start, rows, dims, options)
    terms, unscale = operands(ds)
    dw_c = sum_products(terms, lambda d: dot(x.T, d)) * unscale
    dw = lax.dynamic_update_slice_in_dim(dw, dw_c.astype(dw.dtype), start, axis=1)
    if dims.V % chunk:  # the last chunk's columns of the chunk before stay out of dx
      new = (start + jnp.arange(chunk, dtype=jnp.int32) >= c * chunk)[None, :]
      terms, unscale = operands(jnp.where(new, ds, 0))
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
