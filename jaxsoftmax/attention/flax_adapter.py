"""`flax_attention`: `dot_product_attention` with the calling convention of Flax's
``attention_fn``, for ``flax.nnx.MultiHeadAttention(..., attention_fn=flax_attention)``.

nnx calls its attention function with keywords for dropout, dtype, precision and weight
sowing that a fused kernel has no use for or cannot honour, and with ``is_causal``: the
value given to the layer's call (False unless the call says otherwise). This adapter
accepts them all: it casts to ``dtype`` when one is given, reads Flax's 0/1 float masks
as booleans, and raises a clear error for what the kernels cannot do (dropout while
training, sowing the attention weights, which are never formed). ``precision`` is
ignored: the kernels multiply in the input dtype and accumulate in float32.

Options of our own (``is_causal``, ``local_window_size``, ``segment_ids``, ...) go in
through `flax_attention_fn`. ``functools.partial(flax_attention, is_causal=True)`` does
not work: nnx passes its own ``is_causal`` on every call, which wins over the partial's.

Masks: a mask array goes to the kernels, which read it by tiles (the Triton backend;
`dot_product_attention`'s ``mask``). A mask known when the layer runs (not traced) that
is all True or exactly the causal mask (``nnx.make_causal_mask``) becomes no mask or
``is_causal=True``, which the Hopper kernels also run and which skips whole blocks
without reading a mask. Inside ``jax.jit`` a mask is traced, and `dot_product_attention`
checks it at run time: a padded batch's mask, causal or not (``make_attention_mask`` of
padding masks, ``make_causal_mask``, their ``combine_masks``), runs as query and key
lengths with or without ``is_causal``; any other as a mask array. A row that a mask
leaves without any key gives 0, where nnx's own attention averages the values.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxsoftmax.attention.api import dot_product_attention

__all__ = ["flax_attention", "flax_attention_fn"]


def _read_mask(mask, T: int, S: int):
  """(mask or None, whether it is the causal mask) for a boolean mask, read on the host
  when it is concrete (in eager code, or a constant inside ``jax.jit``, where only the
  host can read it); a traced mask is returned as it is. The causal pattern is formed
  only for a mask with a T x S plane, so the check costs the mask's own size."""
  if isinstance(mask, jax.core.Tracer):
    return mask, False
  values = np.asarray(mask)
  if values.all():
    return None, False
  if values.shape[-2:] == (T, S) and (values == np.tri(T, S, dtype=bool)).all():
    return None, True
  return mask, False


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
    mask, causal = _read_mask(mask.astype(bool), query.shape[-3], key.shape[-3])
    is_causal = is_causal or causal
  return dot_product_attention(query, key, value, bias, mask, is_causal=is_causal, **kwargs)


def flax_attention_fn(*, is_causal: bool = False, **options):
  """An ``attention_fn`` for nnx with options of our own that stick: ``is_causal=True``
  makes every call causal whatever nnx passes (its ``is_causal`` only adds to it), and
  ``options`` (``local_window_size``, ``segment_ids``, ``logits_soft_cap``,
  ``implementation``, ...) go to `dot_product_attention`.

      nnx.MultiHeadAttention(..., attention_fn=js.flax_attention_fn(is_causal=True))
  """
  if not isinstance(is_causal, bool):
    raise TypeError(f"flax_attention_fn: is_causal must be a bool, got {is_causal!r}")
  reserved = {"bias", "mask", "dtype", "dropout_rate", "deterministic", "module"} & set(options)
  if reserved:
    raise TypeError(f"flax_attention_fn: {sorted(reserved)} are nnx's to pass, per call")

  always_causal = is_causal

  def attention_fn(query, key, value, bias=None, mask=None, *, is_causal=False, **flax):
    return flax_attention(query, key, value, bias, mask,
                          is_causal=is_causal or always_causal, **flax, **options)

  return attention_fn
