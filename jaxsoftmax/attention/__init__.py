"""FlashAttention forward and backward as Pallas kernels: `dot_product_attention`, and
`flax_attention` for Flax's ``attention_fn``. Backends: `triton` (portable) and
`mosaic_gpu` (Hopper); `api` chooses between them. `ring` shards the sequence over
devices (context parallelism)."""

from jaxsoftmax.attention.api import (BlockSizes, HopperBlockSizes, attention_kernels,
                                      dot_product_attention, select_backend)
from jaxsoftmax.attention.flax_adapter import flax_attention, flax_attention_fn
from jaxsoftmax.attention.ring import (context_parallel_attention, ring_attention,
                                       zigzag_permute, zigzag_unpermute)

__all__ = ["dot_product_attention", "attention_kernels", "flax_attention",
           "flax_attention_fn", "BlockSizes",
           "HopperBlockSizes",
           "select_backend", "ring_attention", "context_parallel_attention",
           "zigzag_permute", "zigzag_unpermute"]
