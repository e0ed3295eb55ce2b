"""`flax_attention`: `dot_product_attention` with the calling convention of Flax's
``attention_fn``, for ``flax.nnx.MultiHeadAttention(..., attention_fn=flax_attention)``.

nnx calls its attention function with keywords for dropout, dtype, precision and weight
sowing that a fused kernel has no use for or cannot honour. This adapter accepts them all:
it casts to ``dtype`` when one is given, reads Flax's 0/1 float masks as booleans (a
mask takes the reference path, see `dot_product_attention`), and raises a clear error for
what the kernels cannot do (dropout while training, sowing the attention weights, which
are never formed).
Other keywords (``scale``, ``segment_ids``, ``local_window_size``, ...) go to
`dot_product_attention`, e.g. through ``functools.partial``. ``precision`` is ignored:
the kernels multiply in the input dtype and accumulate in float32.
"""

from __future__ import annotations

from jaxsoftmax.attention.api import dot_product_attention


def flax_attention(query, key, value, bias=None, mask=None, *, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=True, dtype=None,
                   precision=None, module=None, is_causal=False, **kwargs):
  """Attention for ``flax.nnx.MultiHeadAttention(attention_fn=...)``; see the module
  docstring. Layout (B, T, N, H), as nnx's."""
  del broadcast_dropout, dropout_rng, precision  # no dropout to apply; see the docstring
  if dropout_rate and not deterministic:
    raise NotImplementedError(
        f"flax_attention: attention dropout (dropout_rate={dropout_rate}) is not supported; "
        "use dropout_rate=0.0 or deterministic=True")
  if module is not None:
    raise NotImplementedError("flax_attention: sow_weights=True needs the attention "
                              "weights, which the FlashAttention kernels never form")
  if dtype is not None:
    query, key, value = (x.astype(dtype) for x in (query, key, value))
  if mask is not None:  # Flax's masks (nnx.make_causal_mask, ...) are 0/1 floats
    mask = mask.astype(bool)
  return dot_product_attention(query, key, value, bias, mask, is_causal=is_causal, **kwargs)
