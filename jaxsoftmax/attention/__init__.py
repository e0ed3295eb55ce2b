"""FlashAttention forward and backward as Pallas kernels: `dot_product_attention`, and
`flax_attention` for Flax's ``attention_fn``."""

from jaxsoftmax.attention.api import BlockSizes, dot_product_attention
from jaxsoftmax.attention.flax_adapter import flax_attention

__all__ = ["dot_product_attention", "flax_attention", "BlockSizes"]
