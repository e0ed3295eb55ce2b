"""How a row-wise op is cut into programs: `RowTiling` (a kernel variant and its block
sizes, docs: `jaxsoftmax.rows.engine`) and the defaults for a shape (`default_tiling`),
tuned on an H200."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl

__all__ = ["RowTiling", "default_tiling", "VARIANTS", "RESIDENT_MAX_COLS", "MAX_TILE_ELEMS"]

VARIANTS = ("resident", "online", "split")

# Largest row a resident program holds: 16384 float32 values are 32 registers per thread
# at 16 warps, leaving room for the exp and the output before Triton spills. 16-bit rows
# of 32768 held by 32 warps (32 values a thread) were slower on the H200 than the online
# variant's two reads (4096x32768 bfloat16 softmax 207 against 164 us,
# benchmarks/results/tuning/softmax_wide.md against softmax_sweep_forward.md): one such
# program per SM leaves little in flight.
RESIDENT_MAX_COLS = 16384
# Short rows share a program up to this many elements. On the H200 one row of 1024 or
# more per program beat 2 to 16 rows per program at the same row length (H200 sweep,
# benchmarks/results/tuning/tune_rows.md): many small programs hide latency better.
ROWS_TILE_ELEMS = 1024
# Column block of the streaming variants, in bytes per row: 16 KB beat 8 and 32 KB on
# the long-row shapes of the H200 sweep.
STREAM_BLOCK_BYTES = 16384
# Tile of the pure map kernel: 16384 elements reached the copy ceiling on every shape.
MAP_TILE_ELEMS = 16384
# Programs per SM the split variant aims for: short chunks (2 column blocks) were the
# fastest in the H200 sweep; fewer, longer chunks leave HBM idle at the tail.
SPLIT_PROGRAMS_PER_CORE = 64
# Guard against tilings whose tile cannot live in registers.
MAX_TILE_ELEMS = 1 << 17

def _is_pow2(n: int) -> bool:
  return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class RowTiling:
  """How a row-wise op is cut into programs.

  Attributes:
    variant: ``"resident"``, ``"online"`` or ``"split"`` (see the module docstring).
    block_rows: rows per program; a power of two.
    block_cols: columns per tile; a power of two. ``resident`` needs it >= the row length.
    chunk_blocks: ``split`` only: column blocks (of ``block_cols``) per program.
    num_warps: warps per program; a power of two from 1 to 32.
  """

  variant: str
  block_rows: int = 1
  block_cols: int = 1024
  chunk_blocks: int = 1
  num_warps: int = 4

  def __post_init__(self):
    if self.variant not in VARIANTS:
      raise ValueError(f"RowTiling.variant must be one of {VARIANTS}, got {self.variant!r}")
    for field in ("block_rows", "block_cols"):
      if not _is_pow2(getattr(self, field)):
        raise ValueError(
            f"RowTiling.{field} must be a power of two, got {getattr(self, field)!r}")
    if self.block_rows * self.block_cols > MAX_TILE_ELEMS:
      raise ValueError(
          f"RowTiling: block_rows * block_cols = {self.block_rows * self.block_cols} "
          f"exceeds {MAX_TILE_ELEMS} elements, more than a program's registers hold")
    if not (isinstance(self.chunk_blocks, int) and self.chunk_blocks >= 1):
      raise ValueError(f"RowTiling.chunk_blocks must be a positive int, got {self.chunk_blocks!r}")
    if not (_is_pow2(self.num_warps) and self.num_warps <= 32):
      raise ValueError(f"RowTiling.num_warps must be a power of two <= 32, got {self.num_warps!r}")


def _warps_for(tile_elems: int) -> int:
  # About 16 elements per thread (four 16-byte loads of float32), 4 to 16 warps.
  return max(4, min(16, tile_elems // 512))


def default_tiling(n_rows: int, n_cols: int, dtype, *, reduces: bool) -> RowTiling:
  """The tiling jaxsoftmax uses for an (n_rows, n_cols) view, tuned on an H200."""
  cols_pow2 = pl.next_power_of_2(n_cols)
  rows_pow2 = pl.next_power_of_2(n_rows)
  stream_cols = STREAM_BLOCK_BYTES // jnp.dtype(dtype).itemsize
  if not reduces:
    block_cols = min(cols_pow2, MAP_TILE_ELEMS)
    block_rows = min(rows_pow2, max(1, MAP_TILE_ELEMS // block_cols))
    return RowTiling("split", block_rows, block_cols, 1, _warps_for(block_rows * block_cols))
  if cols_pow2 <= RESIDENT_MAX_COLS:
    block_rows = min(rows_pow2, max(1, ROWS_TILE_ELEMS // cols_pow2))
    return RowTiling("resident", block_rows, cols_pow2, 1,
                     _warps_for(block_rows * cols_pow2))
  cores = pallas.num_cores()
  if n_rows >= 2 * cores:
    return RowTiling("online", 1, stream_cols, 1, _warps_for(stream_cols))
  chunks = pl.cdiv(SPLIT_PROGRAMS_PER_CORE * cores, n_rows)
  chunk_blocks = max(1, pl.cdiv(pl.cdiv(n_cols, chunks), stream_cols))
  return RowTiling("split", 1, stream_cols, chunk_blocks, _warps_for(stream_cols))


