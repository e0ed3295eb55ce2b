"""Linear layer + softmax cross-entropy without the logits in memory: `api` (the public
function, its backend registry and derivatives, and the algorithm), `call` (what a
backend is given and provides), `tiling` (the kernels' tiles), `logits` (the math the
kernels share), one module per backend (`mosaic_gpu`, `triton`, `xla_chunks`), `chunked`
(the backward every backend shares) and `reference` (the plain-JAX truth, also its XLA
path)."""

from jaxsoftmax.linear_cross_entropy.api import linear_cross_entropy
from jaxsoftmax.linear_cross_entropy.tiling import (LinearCrossEntropyHopperTiling,
                                                    LinearCrossEntropyTiling)

__all__ = ["linear_cross_entropy", "LinearCrossEntropyTiling",
           "LinearCrossEntropyHopperTiling"]
