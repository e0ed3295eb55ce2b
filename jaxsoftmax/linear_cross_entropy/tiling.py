"""The kernels' tiles: `LinearCrossEntropyTiling` (the Triton forward's blocks, the chunked
backward's chunk) with `LinearCrossEntropyHopperTiling` (the Hopper kernels'), and the
problem they cut (`Dims`). Which kernels run is `implementation=`'s choice
(`linear_cross_entropy.api.REGISTRY`), not the tiles'."""

from __future__ import annotations

import dataclasses

from jaxsoftmax._core import pallas
from jaxsoftmax._core.inputs import check_optional_positive_int
from jaxsoftmax._core.pallas import pl

__all__ = ["LinearCrossEntropyTiling", "LinearCrossEntropyHopperTiling", "Dims",
           "HOPPER_CONSUMERS", "HOPPER_BLOCK_ROWS", "HOPPER_BLOCK_HIDDEN"]

# The chunked backward's default chunk: about this many logits (64 MiB in float32).
_CHUNK_LOGITS = 1 << 24

# The Hopper kernels' fixed geometry (`mosaic_gpu`): two consumer warpgroups of one wgmma
# row block (64 rows) each; hidden-dim chunks of one 128-byte swizzled row of 16-bit values.
HOPPER_CONSUMERS = 2
HOPPER_BLOCK_ROWS = 64
HOPPER_BLOCK_HIDDEN = 64


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyHopperTiling:
  """Tiles of the Hopper kernels (`mosaic_gpu`: the forward and the backward's ds).

  Attributes:
    block_vocab: vocabulary columns per tile (the wgmma's N): the consumers' float32
      accumulators hold 64 x block_vocab, 128 registers a thread at 256.
    num_stages: hidden chunks in flight (slots of the shared-memory ring).
    vocab_splits: vocabulary ranges of the forward (CTAs per block of rows); None gives
      each range about 32 tiles.
  """

  # From the H200 sweep at both benchmark shapes: 3 stages beat 4 (14.1 against 14.5 ms,
  # 15.4 against 15.6), 256 columns beat 192 and 128
  # (benchmarks/results/tuning/tune_linear_cross_entropy_hopper.md, ..._gemma.md).
  block_vocab: int = 256
  num_stages: int = 3
  vocab_splits: int | None = None

  def __post_init__(self):
    if self.block_vocab not in (64, 128, 192, 256):
      raise ValueError("LinearCrossEntropyHopperTiling.block_vocab must be 64, 128, 192 "
                       f"or 256, got {self.block_vocab!r}")
    if not (isinstance(self.num_stages, int) and self.num_stages >= 2):
      raise ValueError("LinearCrossEntropyHopperTiling.num_stages must be an int >= 2, "
                       f"got {self.num_stages!r}")
    check_optional_positive_int(self.vocab_splits, "LinearCrossEntropyHopperTiling.vocab_splits")

  def ring_bytes(self, itemsize: int) -> int:
    """The ring's bytes (x chunks of both consumers and a W chunk per slot) and 1 KiB for
    the barriers and alignment: the shared memory both kernels take besides their
    outputs on the way out."""
    slot = (HOPPER_CONSUMERS * HOPPER_BLOCK_ROWS + self.block_vocab) * HOPPER_BLOCK_HIDDEN
    return self.num_stages * slot * itemsize + 1024

  def smem_bytes(self, itemsize: int) -> int:
    """The forward's shared memory: the ring and the row statistics on their way out."""
    return self.ring_bytes(itemsize) + 3 * HOPPER_CONSUMERS * HOPPER_BLOCK_ROWS * 4

  def dlogits_smem_bytes(self, itemsize: int) -> int:
    """The ds kernel's shared memory: the ring and a ds tile per consumer."""
    return (self.ring_bytes(itemsize)
            + HOPPER_CONSUMERS * HOPPER_BLOCK_ROWS * self.block_vocab * itemsize)


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyTiling:
  """Tiles of the kernels.

  Attributes:
    block_rows: rows of hidden per program of the Triton forward.
    block_vocab: vocabulary columns per logit tile of the Triton forward.
    block_hidden: hidden-dim chunk of each of its tile products.
    vocab_splits: vocabulary ranges of the Triton forward (programs per block of rows);
      None picks enough programs to fill the GPU.
    num_warps, num_stages: Triton launch parameters.
    chunk_vocab: vocabulary columns per chunk of the backward (`chunked`); None picks
      about 2**24 logits per chunk (a power of two, at least 1024 columns).
    hopper: the Hopper kernels' `LinearCrossEntropyHopperTiling`; None: its defaults.
  """

  block_rows: int = 64
  block_vocab: int = 128
  block_hidden: int = 64
  vocab_splits: int | None = None
  num_warps: int = 4
  num_stages: int = 2
  chunk_vocab: int | None = None
  hopper: LinearCrossEntropyHopperTiling | None = None

  @property
  def hopper_tiling(self) -> LinearCrossEntropyHopperTiling:
    """The Hopper kernels' tiles: ``hopper``, or their defaults."""
    return self.hopper or LinearCrossEntropyHopperTiling()

  def __post_init__(self):
    for name in ("block_rows", "block_vocab", "block_hidden"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= 16 and value & (value - 1) == 0):
        raise ValueError(f"LinearCrossEntropyTiling.{name} must be a power of two >= 16, "
                         f"got {value!r}")
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
    """(vocabulary ranges, tiles per range) of the Triton forward; every range holds a
    tile."""
    wanted = self.tiling.vocab_splits
    if wanted is None:  # two programs per SM
      wanted = pl.cdiv(2 * pallas.num_cores(), self.row_blocks)
    return pallas.even_groups(self.vocab_tiles, wanted)
