"""Block sizes of the attention kernels, the problem's dimensions, and the optional
per-batch-row inputs (lengths, segment ids) that travel with the kernels."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsoftmax import _backend
from jaxsoftmax._backend import pl

# Triton's tensor-core dots need every dimension of a tile to be at least 16.
MIN_BLOCK = 16


def _check_block(name: str, value) -> None:
  if not (isinstance(value, int) and value >= MIN_BLOCK and value & (value - 1) == 0):
    raise ValueError(f"BlockSizes.{name} must be a power of two >= {MIN_BLOCK}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the attention kernels; `BlockSizes.default` picks them from the shape.

  Attributes:
    block_q, block_k: query rows and key rows per tile of the forward kernel.
    block_q_bwd, block_k_bwd: the same for the two backward kernels.
    num_warps, num_warps_bwd: warps per program, forward and backward.
    num_stages: Triton's software-pipelining depth of the key/value (or query) loops.
  """

  block_q: int = 128
  block_k: int = 64
  block_q_bwd: int = 64
  block_k_bwd: int = 64
  num_warps: int = 8
  num_warps_bwd: int = 8
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
      _check_block(name, getattr(self, name))
    for name in ("num_warps", "num_warps_bwd"):
      value = getattr(self, name)
      if value not in (1, 2, 4, 8, 16):
        raise ValueError(f"BlockSizes.{name} must be 1, 2, 4, 8 or 16, got {value!r}")
    if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
      raise ValueError(f"BlockSizes.num_stages must be a positive int, got {self.num_stages!r}")

  @classmethod
  def default(cls, T: int, S: int, head_dim: int, dtype) -> "BlockSizes":
    """Tiles that fit the registers for the head dim, no larger than the sequences."""
    h = pad_head_dim(head_dim)
    wide = jnp.dtype(dtype).itemsize == 4 or h > 128  # fewer rows where tiles are heavy
    block_q, block_k = (64, 32) if wide else (128, 64)
    block_q_bwd, block_k_bwd = (32, 32) if wide else (64, 64)
    fit_q = max(MIN_BLOCK, pl.next_power_of_2(T))
    fit_k = max(MIN_BLOCK, pl.next_power_of_2(S))
    return cls(min(block_q, fit_q), min(block_k, fit_k), min(block_q_bwd, fit_q),
               min(block_k_bwd, fit_k), num_warps=4 if h <= 64 else 8,
               num_warps_bwd=4 if h <= 64 else 8)


def pad_head_dim(head_dim: int) -> int:
  """Head dims are padded to a power of two (at least 16) inside the kernels."""
  return max(MIN_BLOCK, pl.next_power_of_2(head_dim))


@dataclasses.dataclass(frozen=True)
class Dims:
  """B, T, N, H of the query and S, K of the keys; H_pad the padded head dim."""

  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  H_pad: int

  @classmethod
  def of(cls, q, k) -> "Dims":
    B, T, N, H = q.shape
    return cls(B, T, k.shape[1], N, k.shape[2], H, pad_head_dim(H))

  def tile_mask(self, row_ok, h_ok, rows: int):
    """The (rows, H_pad) load/store mask from its row and head-dim parts (None: none)."""
    if row_ok is None and h_ok is None:
      return None
    if row_ok is None:
      return jnp.broadcast_to(h_ok[None, :], (rows, self.H_pad))
    if h_ok is None:
      return jnp.broadcast_to(row_ok[:, None], (rows, self.H_pad))
    return row_ok[:, None] & h_ok[None, :]


@dataclasses.dataclass(frozen=True)
class Aux:
  """Which of (query lengths, key lengths, query segment ids, key segment ids) are given.

  Lengths are (B,) int32, segment ids (B, T) and (B, S) int32; absent ones are None.
  """

  present: tuple[bool, bool, bool, bool]

  @classmethod
  def of(cls, arrays) -> tuple["Aux", list[jax.Array]]:
    """The static description of the 4 optional arrays, and the ones that are given."""
    return cls(tuple(a is not None for a in arrays)), [a for a in arrays if a is not None]

  @property
  def count(self) -> int:
    return sum(self.present)

  def unpack(self, refs):
    refs = iter(refs)
    return tuple(next(refs) if here else None for here in self.present)

  def specs(self, *, q_rows: int, q_index, kv_rows: int, kv_index, batch_index):
    """BlockSpecs: lengths as one (1,) element per batch row; segment ids as tiles of
    ``q_rows`` / ``kv_rows`` placed by the index maps (grid -> (batch row, block))."""
    length = pl.BlockSpec((1,), lambda *g: (batch_index(*g),))
    candidates = (length, length, pl.BlockSpec((None, q_rows), q_index),
                  pl.BlockSpec((None, kv_rows), kv_index))
    return [spec for spec, here in zip(candidates, self.present) if here]


def load_scalar(ref):
  """A per-batch-row scalar (a length) from its (1,) block, or None without a ref."""
  return None if ref is None else jnp.max(_backend.load(ref))
