"""Flax nnx modules on jaxsoftmax's kernels (needs Flax): `LayerNorm` and `RMSNorm`, the
drop-ins for ``flax.nnx.LayerNorm`` and ``flax.nnx.RMSNorm`` (`jaxsoftmax.norms.nnx`).
``js.nnx`` is importable as an attribute after ``import jaxsoftmax as js``: it is loaded
on first use."""

from jaxsoftmax.norms.nnx import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "RMSNorm"]
