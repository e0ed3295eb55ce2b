"""The norms' reference: layer_norm and rms_norm (the residual add included) in plain
jnp, also their XLA path (float64, empty inputs, and by default off a GPU)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxsoftmax._core.inputs import RowView

__all__ = ["normalize"]


def normalize(x, residual, scale, bias, *, rms: bool, epsilon: float, scale_offset: float,
              view: RowView):
  """The XLA path (float64 inputs, empty arrays, and by default off a GPU): plain jnp
  in float32 at least, as the kernels; h and y in x's dtype."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  h = x if residual is None else (x.astype(acc) + residual.astype(acc)).astype(x.dtype)
  h32, axes = h.astype(acc), view.axes
  if rms:
    y = h32 * lax.rsqrt(jnp.mean(jnp.square(h32), axis=axes, keepdims=True) + epsilon)
  else:
    mean = jnp.mean(h32, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(h32 - mean), axis=axes, keepdims=True)
    y = (h32 - mean) * lax.rsqrt(var + epsilon)
  shape = tuple(x.shape[a] if a in axes else 1 for a in range(x.ndim))
  if scale is not None:
    y = y * (scale.astype(acc).reshape(shape) + scale_offset)
  if bias is not None:
    y = y + bias.astype(acc).reshape(shape)
  y = y.astype(x.dtype)
  return y if residual is None else (y, h)
