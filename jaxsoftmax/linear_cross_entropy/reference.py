"""The linear cross-entropy's reference: the logits in memory (in float32 at least, XLA's
product), then `cross_entropy`'s reference loss; also the op's XLA path (float64, empty
inputs, and by default off a GPU)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxsoftmax.cross_entropy import reference
from jaxsoftmax.softmax import reference as softmax_reference

__all__ = ["linear_cross_entropy"]


def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index=-100,
                         label_smoothing=0.0, z_loss=0.0, logit_soft_cap=None,
                         reduction="mean", return_lse=False):
  """The loss (and with ``return_lse`` the lse of each row) of the logits
  ``hidden @ weight (+ bias)``, soft-capped by ``logit_soft_cap``."""
  acc = jnp.promote_types(hidden.dtype, jnp.float32)
  logits = jnp.dot(hidden, weight, preferred_element_type=acc)
  if bias is not None:
    logits = logits + bias.astype(acc).reshape((1,) * (logits.ndim - 1) + bias.shape)
  if logit_soft_cap is not None:
    logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
  loss = reference.cross_entropy(logits, labels, ignore_index=ignore_index,
                                 label_smoothing=label_smoothing, z_loss=z_loss,
                                 reduction=reduction)
  return (loss, softmax_reference.logsumexp(logits, axis=-1)) if return_lse else loss
