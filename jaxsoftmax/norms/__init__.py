"""layer_norm and rms_norm: `api` (the public functions, their derivatives and row ops),
`reference` (the plain-JAX truth, also their XLA path) and `nnx` (Flax modules)."""

from jaxsoftmax.norms.api import layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm"]
