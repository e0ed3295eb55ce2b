"""FlashAttention forward and backward as Pallas kernels: `dot_product_attention`
(`api`: input checks, the choice of backend, the derivatives), and `flax_attention` for
Flax's ``attention_fn`` (`flax_adapter`). One folder per kernel backend: `triton`
(portable) and `mosaic_gpu` (Hopper); what both share: `call` (one call's static
choices), `masks`, `logits`; `reference`: the plain-JAX truth and the XLA path.
`context_parallel` shards the sequence over devices."""

from jaxsoftmax.attention.api import (BlockSizes, HopperBlockSizes, attention_kernels,
                                      dot_product_attention, select_backend)
from jaxsoftmax.attention.context_parallel import (context_parallel_attention,
                                                   ring_attention, zigzag_permute,
                                                   zigzag_unpermute)
from jaxsoftmax.attention.flax_adapter import flax_attention, flax_attention_fn

__all__ = ["dot_product_attention", "attention_kernels", "flax_attention",
           "flax_attention_fn", "BlockSizes", "HopperBlockSizes", "select_backend",
           "ring_attention", "context_parallel_attention", "zigzag_permute",
           "zigzag_unpermute"]
