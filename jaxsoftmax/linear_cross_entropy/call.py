"""What the linear cross-entropy's kernel backends are given (`Call`) and what each
provides (`LinearCrossEntropyBackend`): the seam of `jaxsoftmax._core.backends`, with
the entry points this op's backends share."""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import jax

from jaxsoftmax.linear_cross_entropy.logits import Options, Rows
from jaxsoftmax.linear_cross_entropy.tiling import Dims

__all__ = ["Call", "LinearCrossEntropyBackend"]


@dataclasses.dataclass(frozen=True)
class Call:
  """One call's static choices, no arrays.

  Attributes:
    dtype: the inputs' dtype name.
    dims: the problem's sizes and the tiles.
    options: smoothing, z-loss, soft cap, whether a bias is given, interpret mode.
    named: the caller named the backend (``implementation=``), which lets the Hopper
      kernels run in Pallas' Mosaic GPU interpreter (otherwise interpret mode runs the
      Triton forward, the cheaper one to interpret).
  """

  dtype: str
  dims: Dims
  options: Options
  named: bool = False

  @property
  def interpret(self) -> bool:
    return self.options.interpret


# A chunk's ds (rows, chunk) in the inputs' dtype from its weight columns w_c (H, chunk)
# and its first column: a backend's own kernel for the chunked backward.
ChunkDs = Callable[[jax.Array, jax.Array], jax.Array]


class LinearCrossEntropyBackend(Protocol):
  """A kernel backend of `jaxsoftmax.linear_cross_entropy` (a module: `mosaic_gpu`,
  `triton`, `xla_chunks`)."""

  NAME: str
  # Whether the forward's softmax state comes from the very products the chunked backward
  # recomputes (XLA's), so that float32 needs no state of its own (`chunked.backward`).
  STATE_FROM_XLA: bool

  def unsupported(self, call: Call) -> str | None:
    """Why this backend cannot run ``call``, or None when it can."""

  def forward(self, x, w, b, labels, call: Call):
    """Per row, float32 (R,): the softmax state as its shift m and log l (lse = m +
    log l), the label's logit s_y and Σ_j s_j (0 where label smoothing is off)."""

  def chunk_ds(self, x, rows: Rows, call: Call) -> ChunkDs | None:
    """The backward's ds kernel for each vocabulary chunk (`chunked.backward`), or None
    for XLA's product and elementwise pass."""
