"""Context parallelism: attention over a sequence sharded on a mesh axis (`ring`: the
ring and all-gather strategies, `ring_attention` inside a user's shard_map and
`context_parallel_attention` for global arrays) and its balanced layout (`zigzag`)."""

from jaxsoftmax.attention.context_parallel.ring import (context_parallel_attention,
                                                        ring_attention)
from jaxsoftmax.attention.context_parallel.zigzag import zigzag_permute, zigzag_unpermute

__all__ = ["ring_attention", "context_parallel_attention", "zigzag_permute",
           "zigzag_unpermute"]
