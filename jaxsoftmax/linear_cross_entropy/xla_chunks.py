"""The XLA-chunks backend of the linear cross-entropy (``implementation="xla_chunks"``):
the forward as XLA's products (cuBLAS on a GPU), one vocabulary chunk of
``chunk_vocab`` columns at a time, each chunk's softmax state, label logit and Σ_j s
merged into the rows' running ones (`chunked.chunk_states`), so that only a rows x
chunk block of logits is ever in memory; the backward is the chunked one, on the same
products.

It is float32's default on a GPU: Triton runs float32 products as IEEE FMAs off the
tensor cores (`Precision.HIGHEST`, which the 2x rule needs), at about 3 TFLOP/s on the
H200 where XLA's full-precision products reach about 50 (docs/kernels.md, "Linear
cross-entropy"). Any floating dtype runs here, and on any device.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxsoftmax._core.state import safe_shift
from jaxsoftmax.linear_cross_entropy import chunked
from jaxsoftmax.linear_cross_entropy.call import Call, ChunkDs
from jaxsoftmax.linear_cross_entropy.logits import Rows

__all__ = ["NAME", "STATE_FROM_XLA", "unsupported", "forward", "chunk_ds"]

NAME = "xla_chunks"
# The forward's softmax state comes from the products the chunked backward recomputes.
STATE_FROM_XLA = True


def unsupported(call: Call) -> str | None:
  """None: XLA's products run every call that reaches a backend."""
  del call
  return None


def forward(x, w, b, labels, call: Call):
  """Per row, float32 (R,): the softmax state as its shift m and log l, the label's logit
  and Σ_j s_j (0 without label smoothing), from XLA's products chunk by chunk."""
  m, l, label, total = chunked.chunk_states(
      x, w, b, call.dims, call.options, chunked.xla_dot(x.dtype), labels=labels,
      with_total=call.options.label_smoothing > 0)
  return safe_shift(m), jnp.log(l), label, total


def chunk_ds(x, rows: Rows, call: Call) -> ChunkDs | None:
  """None: the chunked backward forms ds in XLA."""
  del x, rows, call
  return None
