"""FlashAttention forward and backward as Pallas kernels: `dot_product_attention`."""

from jaxsoftmax.attention.api import BlockSizes, dot_product_attention

__all__ = ["dot_product_attention", "BlockSizes"]
