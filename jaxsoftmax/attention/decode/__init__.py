"""Decode attention over a KV cache: `api` (the public function), `triton` (the
flash-decoding kernel and the merge of its splits), `reference` (the plain-JAX truth,
also the XLA path)."""

from jaxsoftmax.attention.decode.api import decode_attention

__all__ = ["decode_attention"]
