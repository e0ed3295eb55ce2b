"""The fused kernels' tiles (`LinearCrossEntropyTiling`, the caller's choice of kernels
and block sizes) and the problem they cut (`Dims`)."""

from __future__ import annotations

import dataclasses

from jaxsoftmax._core import pallas
from jaxsoftmax._core.inputs import check_optional_positive_int
from jaxsoftmax._core.pallas import pl
from jaxsoftmax.linear_cross_entropy.mosaic_gpu import LinearCrossEntropyHopperTiling

__all__ = ["LinearCrossEntropyTiling", "Dims"]

_BACKWARDS = ("chunked", "atomic", "two_kernels")

_FORWARDS = ("triton", "mosaic_gpu")

_DLOGITS = ("xla", "mosaic_gpu")

# The chunked backward's default chunk: about this many logits (64 MiB in float32).
_CHUNK_LOGITS = 1 << 24


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyTiling:
  """Tiles of the fused kernels.

  Attributes:
    block_rows: rows of hidden per program.
    block_vocab: vocabulary columns per logit tile.
    block_hidden: hidden-dim chunk of each tile product.
    vocab_splits: vocabulary ranges of the forward (programs per block of rows); None
      picks enough programs to fill the GPU.
    num_warps, num_stages: Triton launch parameters.
    backward: "chunked" (XLA's matrix products over vocabulary chunks), "atomic" (one
      kernel; float32 atomic adds, run-to-run differences in the last bits) or
      "two_kernels" (a dhidden kernel over blocks of rows and a dweight kernel over
      vocabulary tiles, each recomputing the logits); None: "chunked" for 16-bit
      inputs, "two_kernels" for float32 (see `_backward_chunked`).
    chunk_vocab: vocabulary columns per chunk of the chunked backward; None picks about
      2**24 logits per chunk (a power of two, at least 1024 columns).
    forward: the forward's kernel: "triton" (the tiles above) or "mosaic_gpu" (a Hopper
      GPU's tensor cores through Pallas Mosaic GPU, bfloat16 and float16 only;
      interpreted by Pallas' Mosaic GPU interpreter off a GPU; its tiles are
      ``hopper``); None: "mosaic_gpu" where it can run (16-bit inputs on a Hopper GPU,
      not interpreted), else "triton".
    hopper: the "mosaic_gpu" forward's `LinearCrossEntropyHopperTiling`; None: its
      defaults.
    dlogits: how the chunked backward forms a chunk's ds: "xla" (XLA's product writes
      the float32 logits, then an elementwise pass rounds ds to the inputs' dtype) or
      "mosaic_gpu" (one Hopper kernel, `mosaic_gpu.dlogits`: the forward's products with
      ds formed in their epilogue and written in bfloat16; bfloat16 inputs without a
      bias, chunks a multiple of ``hopper.block_vocab``); None: "mosaic_gpu" where it
      can run (not interpreted), else "xla".
  """

  block_rows: int = 64
  block_vocab: int = 128
  block_hidden: int = 64
  vocab_splits: int | None = None
  num_warps: int = 4
  num_stages: int = 2
  backward: str | None = None
  chunk_vocab: int | None = None
  forward: str | None = None
  hopper: LinearCrossEntropyHopperTiling | None = None
  dlogits: str | None = None

  @property
  def hopper_tiling(self) -> LinearCrossEntropyHopperTiling:
    """The "mosaic_gpu" forward's tiles: ``hopper``, or their defaults."""
    return self.hopper or LinearCrossEntropyHopperTiling()

  def __post_init__(self):
    for name in ("block_rows", "block_vocab", "block_hidden"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= 16 and value & (value - 1) == 0):
        raise ValueError(f"LinearCrossEntropyTiling.{name} must be a power of two >= 16, "
                         f"got {value!r}")
    if self.backward is not None and self.backward not in _BACKWARDS:
      raise ValueError(f"LinearCrossEntropyTiling.backward must be one of {_BACKWARDS}, "
                       f"got {self.backward!r}")
    if self.forward is not None and self.forward not in _FORWARDS:
      raise ValueError(f"LinearCrossEntropyTiling.forward must be one of {_FORWARDS}, "
                       f"got {self.forward!r}")
    if self.dlogits is not None and self.dlogits not in _DLOGITS:
      raise ValueError(f"LinearCrossEntropyTiling.dlogits must be one of {_DLOGITS}, "
                       f"got {self.dlogits!r}")
    if self.hopper is not None and not isinstance(self.hopper,
                                                  LinearCrossEntropyHopperTiling):
      raise TypeError("LinearCrossEntropyTiling.hopper must be a "
                      f"LinearCrossEntropyHopperTiling or None, got {self.hopper!r}")
    for name in ("chunk_vocab", "vocab_splits"):
      check_optional_positive_int(getattr(self, name), f"LinearCrossEntropyTiling.{name}")

@dataclasses.dataclass(frozen=True)
class Dims:
  R: int  # rows
  H: int
  V: int
  tiling: LinearCrossEntropyTiling

  @property
  def row_blocks(self) -> int:
    return pl.cdiv(self.R, self.tiling.block_rows)

  @property
  def vocab_tiles(self) -> int:
    return pl.cdiv(self.V, self.tiling.block_vocab)

  @property
  def hidden_chunks(self) -> int:
    return pl.cdiv(self.H, self.tiling.block_hidden)

  @property
  def chunk(self) -> int:
    """Vocabulary columns per chunk of the chunked backward."""
    if self.tiling.chunk_vocab is not None:
      return min(self.tiling.chunk_vocab, self.V)
    columns = 1 << max(10, (_CHUNK_LOGITS // self.R).bit_length() - 1)
    return min(columns, self.V)

  def splits(self) -> tuple[int, int]:
    """(vocabulary ranges, tiles per range) of the forward; every range holds a tile."""
    wanted = self.tiling.vocab_splits
    if wanted is None:  # two programs per SM
      wanted = pl.cdiv(2 * pallas.num_cores(), self.row_blocks)
    return pallas.even_groups(self.vocab_tiles, wanted)
