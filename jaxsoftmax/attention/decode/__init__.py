"""Decode attention over a KV cache: `api` (the public function), `triton` (the
flash-decoding kernel and the merge of its splits), `reference` (the plain-JAX truth,
also the XLA path), `cache` (writing new tokens into a cache)."""

from jaxsoftmax.attention.decode.api import decode_attention
from jaxsoftmax.attention.decode.cache import update_kv_cache

__all__ = ["decode_attention", "update_kv_cache"]
