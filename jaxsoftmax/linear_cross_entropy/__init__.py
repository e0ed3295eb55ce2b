"""Linear layer + softmax cross-entropy without the logits in memory: `api` (the public
function, its dispatch and derivatives, and the algorithm), `tiling` (the caller's
kernels and tiles), `logits` (the math the kernels share), one module per kernel
family (`triton`, `mosaic_gpu`, `chunked`: the default backward over vocabulary
chunks) and `reference` (the plain-JAX truth, also its XLA path)."""

from jaxsoftmax.linear_cross_entropy.api import linear_cross_entropy
from jaxsoftmax.linear_cross_entropy.mosaic_gpu import LinearCrossEntropyHopperTiling
from jaxsoftmax.linear_cross_entropy.tiling import LinearCrossEntropyTiling

__all__ = ["linear_cross_entropy", "LinearCrossEntropyTiling",
           "LinearCrossEntropyHopperTiling"]
