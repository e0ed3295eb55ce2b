"""jaxsoftmax: online-softmax and FlashAttention kernels for JAX, written in Pallas.

Drop-in replacements for jax.nn.softmax / log_softmax / logsumexp /
dot_product_attention, for optax's integer-label softmax cross-entropy and for Flax's
norms, whose backward passes recompute from the saved row statistics. docs/math.md has
the math, docs/numerics.md the numerics contract.
"""

from jaxsoftmax.attention.decode import decode_attention, update_kv_cache
from jaxsoftmax.attention import (BlockSizes, HopperBlockSizes, attention_kernels,
                                  context_parallel_attention, dot_product_attention,
                                  flax_attention, flax_attention_fn, ring_attention,
                                  zigzag_permute, zigzag_unpermute)
from jaxsoftmax.cross_entropy import cross_entropy
from jaxsoftmax.linear_cross_entropy import (LinearCrossEntropyHopperTiling,
                                             LinearCrossEntropyTiling, linear_cross_entropy)
from jaxsoftmax.norms import layer_norm, rms_norm
from jaxsoftmax.rows import RowTiling
from jaxsoftmax.softmax import log_softmax, logsumexp, softmax
from jaxsoftmax._core.state import (merge_attention_states, merge_states, reduce_lse,
                                    reduce_states, state_lse)

__all__ = [
    "softmax",
    "log_softmax",
    "logsumexp",
    "cross_entropy",
    "linear_cross_entropy",
    "LinearCrossEntropyTiling",
    "LinearCrossEntropyHopperTiling",
    "layer_norm",
    "rms_norm",
    "dot_product_attention",
    "decode_attention",
    "update_kv_cache",
    "attention_kernels",
    "flax_attention",
    "flax_attention_fn",
    "ring_attention",
    "context_parallel_attention",
    "zigzag_permute",
    "zigzag_unpermute",
    "BlockSizes",
    "HopperBlockSizes",
    "merge_states",
    "reduce_states",
    "state_lse",
    "merge_attention_states",
    "reduce_lse",
    "RowTiling",
]

__version__ = "0.1.0"


def __getattr__(name: str):
  # jaxsoftmax.nnx needs Flax, which jaxsoftmax itself does not: loaded on first use.
  if name == "nnx":
    import importlib
    return importlib.import_module("jaxsoftmax.nnx")
  raise AttributeError(f"module 'jaxsoftmax' has no attribute {name!r}")
