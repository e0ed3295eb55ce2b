"""Flax nnx modules on jaxsoftmax's kernels: drop-ins for ``flax.nnx.LayerNorm`` and
``flax.nnx.RMSNorm`` (``from jaxsoftmax import nnx as jsnnx``; needs Flax).

Each is Flax's module (same constructor, parameter names and shapes, same dtype
promotion: inputs and parameters promoted together, or to ``dtype``), whose call runs
`jaxsoftmax.layer_norm` / `jaxsoftmax.rms_norm` when the kernels can: normalizing and
feature axes the same, no cross-device ``axis_name``, no ``mask``, and a float32,
bfloat16 or float16 result. Anything else runs Flax's own code. Statistics are float32
Welford states, so ``use_fast_variance`` (Flax's E[x²] - E[x]²) has no effect on the
kernel path. ``js.nnx`` is importable as an attribute after ``import jaxsoftmax as js``
(it is loaded on first use, since it needs Flax).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxsoftmax.norms.api import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm"]

_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _axes(axes, ndim: int) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return tuple(sorted(a % ndim for a in axes))


def _kernel_axis(module, x, mask):
  """The axes for the kernel path, or None where Flax's own code must run."""
  if mask is not None or module.axis_name is not None:
    return None
  axes = _axes(module.reduction_axes, x.ndim)
  if axes != _axes(module.feature_axes, x.ndim) or x.dtype not in _KERNEL_DTYPES:
    return None
  return axes


def _flax_path(call, x, residual, mask):
  """Flax's own code on h = x + residual (returned beside y when given)."""
  if residual is None:
    return call(x, mask=mask)
  h = x + residual
  return call(h, mask=mask), h


class LayerNorm(nnx.LayerNorm):
  """``flax.nnx.LayerNorm`` on `jaxsoftmax.layer_norm`; see the module docstring.

  ``residual`` (x's shape): normalizes h = x + residual in the same kernel and returns
  ``(y, h)``, as `jaxsoftmax.layer_norm`.
  """

  def __call__(self, x, *, mask=None, residual=None):
    scale = self.scale[...] if self.scale else None
    bias = self.bias[...] if self.bias else None
    x, residual, scale, bias = self.promote_dtype((x, residual, scale, bias),
                                                  dtype=self.dtype)
    axes = _kernel_axis(self, x, mask)
    if axes is None:
      return _flax_path(super().__call__, x, residual, mask)
    return layer_norm(x, scale, bias, epsilon=self.epsilon, axis=axes, residual=residual)


class RMSNorm(nnx.RMSNorm):
  """``flax.nnx.RMSNorm`` on `jaxsoftmax.rms_norm`; see the module docstring.

  ``residual`` (x's shape): normalizes h = x + residual in the same kernel and returns
  ``(y, h)``, as `jaxsoftmax.rms_norm`.
  """

  def __call__(self, x, *, mask=None, residual=None):
    scale = self.scale[...] if self.scale else None
    x, residual, scale = self.promote_dtype((x, residual, scale), dtype=self.dtype)
    axes = _kernel_axis(self, x, mask)
    if axes is None:
      return _flax_path(super().__call__, x, residual, mask)
    return rms_norm(x, scale, epsilon=self.epsilon, axis=axes, residual=residual)
