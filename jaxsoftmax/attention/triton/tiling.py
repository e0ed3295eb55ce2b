"""The Triton attention kernels' block sizes, the problem's dimensions, the optional
per-batch-row inputs (lengths, segment ids) that travel with the kernels, and the
in-kernel helpers the forward and backward kernels share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax.attention.call import AuxArrays
from jaxsoftmax.attention.logits import Logits
from jaxsoftmax.attention.masks import MaskSpec, element_mask

# Triton's tensor-core dots need every dimension of a tile to be at least 16.
MIN_BLOCK = 16


def _check_block(name: str, value) -> None:
  if not (isinstance(value, int) and value >= MIN_BLOCK and value & (value - 1) == 0):
    raise ValueError(f"BlockSizes.{name} must be a power of two >= {MIN_BLOCK}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the attention kernels; `BlockSizes.default` picks them from the shape.

  Attributes:
    block_q, block_k: query rows and key rows per tile of the forward kernel, which keeps
      its query tile and walks the key blocks.
    block_q_dkv, block_k_dkv: the dK/dV kernel's tiles; it keeps a key block and walks
      the query blocks, so block_k_dkv is the resident one.
    block_q_dq, block_k_dq: the dQ kernel's tiles; it keeps a query block.
    num_warps, num_stages: warps per program and Triton's software-pipelining depth of
      the block loops, forward (one stage fewer where a bias or mask tile would cost
      the forward programs an SM: `forward_stages`).
    num_warps_bwd, num_stages_bwd: the same for the two backward kernels.
  """

  block_q: int = 128
  block_k: int = 128
  block_q_dkv: int = 64
  block_k_dkv: int = 128
  block_q_dq: int = 128
  block_k_dq: int = 64
  num_warps: int = 8
  num_stages: int = 2
  num_warps_bwd: int = 8
  num_stages_bwd: int = 2

  _BLOCKS = ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq")

  def __post_init__(self):
    for name in self._BLOCKS:
      _check_block(name, getattr(self, name))
    for name in ("num_warps", "num_warps_bwd"):
      value = getattr(self, name)
      if value not in (1, 2, 4, 8, 16):
        raise ValueError(f"BlockSizes.{name} must be 1, 2, 4, 8 or 16, got {value!r}")
    for name in ("num_stages", "num_stages_bwd"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")

  @classmethod
  def default(cls, T: int, S: int, head_dim: int, dtype,
              is_causal: bool = False) -> "BlockSizes":
    """Tiles that fit the registers for the head dim, no larger than the sequences.

    The 16-bit values are the best of `benchmarks/tune_attention.py` on an H200
    (benchmarks/results/tuning/: tune_attention.log, tune_attention_long.md,
    tune_attention_h256.md); float32 tiles are halved, as their operands
    take twice the registers and shared memory.
    """
    h = pow2_head_dim(head_dim)
    if jnp.dtype(dtype).itemsize == 4:
      warps = 4 if h <= 64 else 8
      blocks = cls(block_q=64, block_k=64, block_q_dkv=32, block_k_dkv=64, block_q_dq=64,
                   block_k_dq=32, num_warps=warps, num_stages=2, num_warps_bwd=warps,
                   num_stages_bwd=2)
    elif h <= 64:
      blocks = cls(block_q=64, block_k=64, block_q_dkv=32, block_k_dkv=128, block_q_dq=128,
                   block_k_dq=32, num_warps=4, num_stages=3, num_warps_bwd=4,
                   num_stages_bwd=3)
    elif h <= 128:
      # Long sequences amortize bigger forward tiles (a causal one keeps block_k 64, so
      # that fewer keys fall in its masked diagonal blocks). From 2 · LONG a causal
      # forward takes 256-row query tiles on 16 warps, which halve the key/value reads
      # per query: 491 against 477 TFLOP/s at T = 32768, but 436 against 476 at 16384
      # (benchmarks/results/tuning/tune_attention_long.md).
      if T < LONG:
        forward = dict(block_q=64, block_k=64, num_warps=4)
      elif is_causal and T >= 2 * LONG:
        forward = dict(block_q=256, block_k=64, num_warps=16)
      else:
        forward = dict(block_q=128, block_k=64 if is_causal else 128, num_warps=8)
      blocks = cls(**forward, block_q_dkv=64, block_k_dkv=128, block_q_dq=128, block_k_dq=64,
                   num_stages=3, num_warps_bwd=8, num_stages_bwd=3)
    else:
      blocks = cls(block_q=128, block_k=64, block_q_dkv=64, block_k_dkv=64, block_q_dq=64,
                   block_k_dq=64, num_warps=8, num_stages=2, num_warps_bwd=8,
                   num_stages_bwd=2)
    fit_q = max(MIN_BLOCK, pl.next_power_of_2(T))
    fit_k = max(MIN_BLOCK, pl.next_power_of_2(S))
    return dataclasses.replace(blocks, **{
        name: min(getattr(blocks, name), fit_q if name.startswith("block_q") else fit_k)
        for name in cls._BLOCKS})


# Sequences from this length on take the long-sequence forward tiles (head dims 65-128).
LONG = 16384


def pow2_head_dim(head_dim: int) -> int:
  """The head dim padded to a power of two (at least 16), as the Triton kernels' tiles
  hold it."""
  return max(MIN_BLOCK, pl.next_power_of_2(head_dim))


@dataclasses.dataclass(frozen=True)
class Dims:
  """B, T, N, H of the query and S, K of the keys; Hv the values' head dim (H but for
  asymmetric heads, as MLA's 192 / 128); H_pad and Hv_pad the padded head dims."""

  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  H_pad: int
  Hv: int
  Hv_pad: int

  @classmethod
  def of(cls, q, k, v) -> "Dims":
    B, T, N, H = q.shape
    Hv = v.shape[3]
    return cls(B, T, k.shape[1], N, k.shape[2], H, pow2_head_dim(H), Hv, pow2_head_dim(Hv))

  def head_ok(self, *, value: bool = False):
    """Which of the padded head dims of Q/K (of V, O with ``value``) are real (None when
    none is padding)."""
    real, padded = (self.Hv, self.Hv_pad) if value else (self.H, self.H_pad)
    if padded == real:
      return None
    return jnp.arange(padded, dtype=jnp.int32) < real

  def tile_mask(self, row_ok, h_ok, rows: int, *, value: bool = False):
    """The (rows, H_pad) load/store mask ((rows, Hv_pad) with ``value``) from its row and
    head-dim parts (None: none)."""
    cols = self.Hv_pad if value else self.H_pad
    if row_ok is None and h_ok is None:
      return None
    if row_ok is None:
      return jnp.broadcast_to(h_ok[None, :], (rows, cols))
    if h_ok is None:
      return jnp.broadcast_to(row_ok[:, None], (rows, cols))
    return row_ok[:, None] & h_ok[None, :]


# Shared memory a Hopper SM shares among its blocks (233472 bytes: Nsight Compute's
# "Shared Memory Configuration Size"), and what the driver keeps of it per block.
SM_SHARED_MEMORY = 228 * 1024
BLOCK_RESERVED = 1024
# The most one block may take (232448 bytes, what Triton reports as available).
SHARED_MEMORY = 227 * 1024


def forward_stages(blocks: BlockSizes, dims: "Dims", itemsize: int,
                   plane_tile_bytes: int) -> BlockSizes:
  """``blocks`` with the forward's stages cut (to no fewer than 2) where the tiles of a
  bias or mask (``plane_tile_bytes`` a step) would leave room for fewer programs per SM
  than the plain kernel has. Triton's forward keeps its query tile and ``num_stages``
  copies of the K and V tiles in shared memory, and a plane's tile once beside them:
  at head dim 128, 64 x 64 tiles and three stages, 114688 bytes plain (two programs an
  SM) and 122880 with a bfloat16 bias tile, so one program of four warps an SM, which
  issued an instruction every 5.1 cycles and took the forward to 2.4x its plain time
  (`benchmarks/results/tuning/ncu_attention_bias_heads_triton.log`)."""
  def programs(stages: int, extra: int) -> int:
    need = (blocks.block_q * dims.H_pad
            + stages * blocks.block_k * (dims.H_pad + dims.Hv_pad)) * itemsize + extra
    return SM_SHARED_MEMORY // (need + BLOCK_RESERVED)

  stages = blocks.num_stages
  while stages > 2 and programs(stages, plane_tile_bytes) < programs(blocks.num_stages, 0):
    stages -= 1
  return dataclasses.replace(blocks, num_stages=stages)


def dq_stages(blocks: BlockSizes, dims: "Dims", itemsize: int, plane_tile_bytes: int,
              dbias_tile_bytes: int) -> int:
  """The dQ kernel's pipeline stages: ``blocks.num_stages_bwd``, cut until a program
  fits `SHARED_MEMORY`. It keeps its Q and dO tiles, ``stages`` copies of the K and V
  tiles and ``stages - 1`` of a mask or bias tile (``plane_tile_bytes`` a step), and
  passes the float32 dbias tile it writes (``dbias_tile_bytes``) through shared memory
  once. Compiled offline for sm_90 (`benchmarks/pipelining_offline.py`, H = 128, 128 x
  64 tiles) these terms give its shared memory to the byte: 163840 plain, 229376 with a
  float32 bias tile and 262144 with that bias's gradient too, over the 232448 a block
  may take, so a learnable float32 bias (1, N, T, S) could not have launched at three
  stages (read offline, not seen on a GPU); two take 196608
  (benchmarks/results/tuning/pipelining_attention_offline.md)."""
  bq, bk = blocks.block_q_dq, blocks.block_k_dq

  def need(stages: int) -> int:
    return ((bq + stages * bk) * (dims.H_pad + dims.Hv_pad) * itemsize
            + (stages - 1) * plane_tile_bytes + dbias_tile_bytes)

  stages = blocks.num_stages_bwd
  while stages > 1 and need(stages) > SHARED_MEMORY:
    stages -= 1
  return stages


@dataclasses.dataclass(frozen=True)
class Plane:
  """Which axes of a rank-4 mask or bias array broadcast to (B, N, T, S) are full (True)
  rather than 1: a kernel reads a tile of it, a row, a column or one value."""

  batch: bool
  heads: bool
  rows: bool
  cols: bool

  @classmethod
  def of(cls, x) -> "Plane | None":
    return None if x is None else cls(*(d != 1 for d in x.shape))


@dataclasses.dataclass(frozen=True)
class Aux:
  """Which of the optional arrays (`AuxArrays`: lengths, segment ids, mask, bias, ALiBi
  slopes) are given, and the broadcast shapes of the mask and bias."""

  present: tuple[bool, ...]
  mask: Plane | None = None
  bias: Plane | None = None

  def plane_tile_bytes(self, arrays, block_q: int, block_k: int) -> int:
    """Bytes of the mask's and the bias's tiles a (block_q x block_k) step reads (a
    broadcast axis reads one element); ``arrays`` the `AuxArrays` this describes."""
    arrays = AuxArrays(*arrays)
    return sum((block_q if plane.rows else 1) * (block_k if plane.cols else 1)
               * array.dtype.itemsize
               for plane, array in ((self.mask, arrays.mask), (self.bias, arrays.bias))
               if plane is not None)

  @property
  def spans(self) -> Plane | None:
    """Which axes of the walks' live-block spans (`live_block_spans`) are full: a mask
    array's, and with segment ids the batch rows, query blocks and key blocks too;
    None without either, when the walks take no span."""
    segments = AuxArrays(*self.present).q_segments  # given with the keys'
    if self.mask is None and not segments:
      return None
    mask = self.mask or Plane(False, False, False, False)
    return Plane(batch=mask.batch or segments, heads=mask.heads,
                 rows=mask.rows or segments, cols=mask.cols or segments)

  @classmethod
  def of(cls, arrays) -> tuple["Aux", list[jax.Array]]:
    """The static description of the optional arrays, and the ones that are given."""
    arrays = AuxArrays(*arrays)
    return (cls(arrays.present, Plane.of(arrays.mask), Plane.of(arrays.bias)),
            [a for a in arrays if a is not None])

  def specs(self, *, q_rows: int, q_index, kv_rows: int, kv_index, batch_index,
            plane_spec, slopes_spec):
    """BlockSpecs: lengths as one (1,) element per batch row; segment ids as tiles of
    ``q_rows`` / ``kv_rows`` placed by the index maps (grid -> (batch row, block)); the
    mask and bias by ``plane_spec(plane)``, the slopes by ``slopes_spec``."""
    length = pl.BlockSpec((1,), lambda *g: (batch_index(*g),))
    planes = [None if p is None else plane_spec(p) for p in (self.mask, self.bias)]
    candidates = (length, length, pl.BlockSpec((None, q_rows), q_index),
                  pl.BlockSpec((None, kv_rows), kv_index), *planes, slopes_spec)
    return [spec for spec, here in zip(candidates, self.present) if here]


def _distance(q_idx, k_idx, n: int):
  """|i - j| (float32) for the queries q_idx and keys k_idx, indices below ``n``: taken in
  float32 where that is exact (n <= 2^24), a float subtraction and an absolute value an
  element, where the int32 form took a subtraction, an absolute value and a conversion
  (their SASS, read offline with benchmarks/pipelining_offline.py's compiler)."""
  if n <= 2**24:
    return jnp.abs(q_idx.astype(jnp.float32)[:, None] - k_idx.astype(jnp.float32)[None, :])
  return jnp.abs(q_idx[:, None] - k_idx[None, :]).astype(jnp.float32)


class ScoreTerms(NamedTuple):
  """What one program adds to its scores beyond the position masks (`masks`): the bias
  and the ALiBi term, in x's units (logits = x · factor, `logits.Logits`), and the mask
  array's tile. Tiles are (block_q, block_k), or (block_k, block_q) when ``transposed``
  (the dK/dV kernel).

  With ``one_sided`` (every allowed key at or before its query: causal, or a window with
  no right side) ALiBi's -slope·|i - j| is slope·(j - q0) - slope·(i - q0) for a block
  of queries from q0. On the walks' unmasked blocks `add` adds the column term only (one
  add an element, where the distance took four), and the row term, the same for every
  key of a row, joins the row's statistics instead (`alibi_row`, `tile_max`): those
  tiles' x sit in a frame of their own, and the running maximum, kept true, is shifted
  into it a row at a time. The masked blocks, those that straddle the diagonal among
  them, take the distance itself: near the diagonal both terms reach slope·block_q,
  and a tile in the frame rounded there (float32's ulp at 32 for slope 1/2 and 64-row
  blocks) carried the weightiest keys' logits 20 ulps of lse off in a bfloat16 GPU test
  (docs/kernels.md, ALiBi). Away from the diagonal the frame's rounding grows with the
  distance while the keys' weights fall as exp(-slope·distance)."""

  aux: Aux
  refs: AuxArrays
  factor: float
  dims: Dims
  transposed: bool = False
  one_sided: bool = False

  def plane_tile(self, ref, plane: Plane, head, rows, cols, q_idx, k_idx, shape):
    """A plane's tile for the queries q_idx at ``rows`` of the ref's block and the keys
    k_idx at ``cols``; a broadcast axis reads its one element. ``head``: the head's
    index in a block of several (the dK/dV kernel's group), or None."""
    row_ok = (q_idx < self.dims.T)[:, None] if plane.rows else None
    col_ok = (k_idx < self.dims.S)[None, :] if plane.cols else None
    tile_shape = (q_idx.shape[0] if plane.rows else 1, k_idx.shape[0] if plane.cols else 1)
    ok = (row_ok if col_ok is None else col_ok if row_ok is None else row_ok & col_ok)
    index = (rows if plane.rows else pl.ds(0, 1), cols if plane.cols else pl.ds(0, 1))
    if head is not None:
      index = (head if plane.heads else jnp.int32(0), *index)
    tile = pallas.load(ref.at[index], mask=None if ok is None
                       else jnp.broadcast_to(ok, tile_shape), other=0)
    return jnp.broadcast_to(tile.T if self.transposed else tile, shape)

  def slope(self, head=None):
    """The ALiBi slope of the program's head (of ``head`` in a block of the group's),
    or None."""
    ref = self.refs.alibi_slopes
    if ref is None:
      return None
    return jnp.max(pallas.load(ref if head is None else ref.at[pl.ds(head, 1)]))

  def add(self, x, *, q_idx, k_idx, rows, cols, masked: bool, head=None, slope=None,
          q0=None):
    """x plus the bias and ALiBi terms: x is the tile of the queries q_idx (a block from
    ``q0``), the rows ``rows`` of the refs' blocks, and the keys k_idx, their columns
    ``cols``, in a walk's ``masked`` block or not; ``slope`` from `slope`. One-sided and
    unmasked, the ALiBi term leaves out the row term `alibi_row`."""
    if self.refs.bias is not None:
      bias = self.plane_tile(self.refs.bias, self.aux.bias, head, rows, cols, q_idx,
                             k_idx, x.shape)
      x = x + bias.astype(jnp.float32) * (1 / self.factor)
    if slope is not None and self.one_sided and not masked:  # slope · (j - q0)
      column = (slope / self.factor) * (k_idx - q0).astype(jnp.float32)
      x = x + (column[:, None] if self.transposed else column[None, :])
    elif slope is not None:  # ALiBi: -slope · |i - j|
      distance = _distance(q_idx, k_idx, max(self.dims.T, self.dims.S))
      x = x - (slope / self.factor) * (distance.T if self.transposed else distance)
    return x

  def alibi_row(self, slope, q_idx, q0, *, masked: bool):
    """One-sided ALiBi's row term -slope·(i - q0) in x's units, per query of q_idx (a
    block from ``q0``), which `add` leaves out of an unmasked block's tile; None where
    it leaves nothing out."""
    if slope is None or not self.one_sided or masked:
      return None
    return -(slope / self.factor) * (q_idx - q0).astype(jnp.float32)

  def tile_max(self, m, slope, q_idx, q0, *, masked: bool):
    """A row maximum m (in x's units) as the tiles `add` makes reach it: less one-sided
    ALiBi's row term (`alibi_row`) in an unmasked block, else m itself."""
    row = self.alibi_row(slope, q_idx, q0, masked=masked)
    return m if row is None else m - row

  def tile_maxima(self, m, slope, q_idx, q0):
    """`tile_max` for a walk's masked (True) and unmasked (False) blocks, formed once
    before the walk of a program whose queries are fixed."""
    return {masked: self.tile_max(m, slope, q_idx, q0, masked=masked)
            for masked in (True, False)}

  def mask(self, shape, *, q_idx, k_idx, rows, cols, head=None):
    """The mask array's tile (bool, True: attend) of ``shape``, placed as in `add`; None
    without a mask array."""
    if self.refs.mask is None:
      return None
    return self.plane_tile(self.refs.mask, self.aux.mask, head, rows, cols, q_idx, k_idx,
                           shape) != 0


def live_block_spans(mask=None, segments=None, *, block_rows: int, block_cols: int,
                     n_col_blocks: int, transposed: bool = False):
  """(first, end), int32 (Bs, Ns, row blocks): for each block of ``block_rows`` query
  rows, the blocks of ``block_cols`` keys [first, end) from its first to its last that
  may hold an allowed pair (0, 0 where none does); ``transposed``: the same for blocks
  of keys over the query blocks (the dK/dV walk). A block pair is live where the mask
  array (int8, rank 4, broadcastable to (B, N, T, S)) allows a pair in it, and where
  the ranges [min, max] of the segment ids (``segments``: the queries' (B, T) and the
  keys' (B, S)) of its rows and of its keys overlap: ranges apart hold no equal pair,
  sorted or not. A row axis of the mask that broadcasts is one block, and a column
  axis that does spans all ``n_col_blocks`` or none.

  The walks take these as their ranges (`masks.narrow_ranges`), so that the tiles at
  either end of a block's span that the masks mask entirely are skipped without a
  conditional in the walk: Triton's software pipeliner takes only a loop's top-level
  loads, and with each tile's work in a conditional that skipped it the mask array's
  kernels pipelined no load at all
  (benchmarks/results/tuning/pipelining_attention_offline.md). Packed sequences (sorted
  segment ids) leave each query block the key blocks of its own documents; tiles
  masked entirely inside a span are computed under the mask."""
  lives = []
  if mask is not None:
    lives.append(_mask_live_blocks(mask, block_rows, block_cols, transposed))
  if segments is not None:
    rows, cols = segments[::-1] if transposed else segments
    lives.append(_segment_live_blocks(rows, cols, block_rows, block_cols))
  live = lives[0] if len(lives) == 1 else lives[0] & lives[1]
  live = jnp.broadcast_to(live, (*live.shape[:3], n_col_blocks))
  some = live.any(-1)
  first = jnp.argmax(live, axis=-1)
  end = n_col_blocks - jnp.argmax(live[..., ::-1], axis=-1)
  return (jnp.where(some, first, 0).astype(jnp.int32),
          jnp.where(some, end, 0).astype(jnp.int32))


def _mask_live_blocks(mask, block_rows: int, block_cols: int, transposed: bool):
  """Whether each block pair of the mask array holds an allowed pair: (Bm, Nm, row
  blocks, key blocks), an axis that broadcasts one block."""
  allowed = mask != 0
  if transposed:
    allowed = jnp.swapaxes(allowed, 2, 3)
  Bm, Nm, R, C = allowed.shape
  # One block of rows (or columns) holds them all where there are no more than a block:
  # no padding, so a broadcast row axis (a key mask's) is not padded to a block.
  block_rows, block_cols = min(block_rows, R), min(block_cols, C)
  n_rows, n_cols = pl.cdiv(R, block_rows), pl.cdiv(C, block_cols)
  allowed = jnp.pad(allowed, ((0, 0), (0, 0), (0, n_rows * block_rows - R),
                              (0, n_cols * block_cols - C)))
  return allowed.reshape(Bm, Nm, n_rows, block_rows, n_cols, block_cols).any(axis=(3, 5))


def _segment_live_blocks(row_segments, col_segments, block_rows: int, block_cols: int):
  """Whether the segment-id ranges of each block of rows and block of columns overlap:
  (B, 1, row blocks, column blocks)."""
  def block_range(segments, block: int):
    B, n = segments.shape
    blocks = pl.cdiv(n, block)
    info = jnp.iinfo(segments.dtype)
    padded = lambda fill: jnp.pad(segments, ((0, 0), (0, blocks * block - n)),
                                  constant_values=fill).reshape(B, blocks, block)
    return padded(info.max).min(-1), padded(info.min).max(-1)

  row_lo, row_hi = block_range(row_segments, block_rows)
  col_lo, col_hi = block_range(col_segments, block_cols)
  live = ((row_lo[:, :, None] <= col_hi[:, None, :])
          & (col_lo[:, None, :] <= row_hi[:, :, None]))
  return live[:, None]


def span_sources(aux_arrays) -> tuple:
  """`live_block_spans`' mask and segments in ``aux_arrays`` (`AuxArrays`): the mask
  array, and the (query, key) segment ids; None for either not given."""
  arrays = AuxArrays(*aux_arrays)
  segments = None if arrays.q_segments is None else (arrays.q_segments, arrays.kv_segments)
  return arrays.mask, segments


def query_spans(aux_arrays, block_q: int, block_k: int, dims: Dims) -> list:
  """The inputs of a query-block kernel's `QueryBlockLaunch.span_specs`: the live key
  blocks (first, end) per query block (`live_block_spans`) of the mask array and the
  segment ids in ``aux_arrays`` (`AuxArrays`), none without either."""
  mask, segments = span_sources(aux_arrays)
  if mask is None and segments is None:
    return []
  return list(live_block_spans(mask, segments, block_rows=block_q, block_cols=block_k,
                               n_col_blocks=pl.cdiv(dims.S, block_k)))


def span_spec(plane: Plane, block_index, *, blocked: bool, heads: int = 1):
  """The BlockSpec of `live_block_spans`' first or end in a kernel, whose axes
  ``plane`` (`Aux.spans`) describes: the value of the program's row block
  (``block_index(*grid)``: its batch row, head and row block; ``blocked``: the spans
  have a row axis, else one block), ``heads`` of them (the dK/dV kernel's group) where
  they have a head axis."""
  def index(*g):
    b, n, blk = block_index(*g)
    return (b if plane.batch else 0, n if plane.heads else 0, blk if blocked else 0)
  return pl.BlockSpec((None, heads if plane.heads else 1, 1), index)


def split_span_refs(refs, aux: Aux):
  """((first_ref, end_ref), the refs after them): a kernel's refs of `span_spec`, which
  come next where the call has a mask array or segment ids (`Aux.spans`), else
  (None, None)."""
  return (tuple(refs[:2]), refs[2:]) if aux.spans else ((None, None), refs)


def load_span(first_ref, end_ref, head=None):
  """(first, end) from the refs of `span_spec` (of the group's ``head``), or None
  without them."""
  if first_ref is None:
    return None
  return tuple(load_scalar(ref if head is None else ref.at[pl.ds(head, 1)])
               for ref in (first_ref, end_ref))


class QueryBlockLaunch(NamedTuple):
  """How a kernel with one program per (query block, batch row, query head) that walks the
  key blocks (the forward and the dQ kernel) is launched; see `query_block_launch`."""

  q_block: Callable[[Any], Any]  # program index -> query block
  grid: tuple[int, int, int]
  q_tile: Any  # BlockSpec of a (block_q, H_pad) tile of q or dQ
  o_tile: Any  # BlockSpec of a (block_q, Hv_pad) tile of o or dO
  kv_all: Any  # BlockSpec of all key rows of the K head of the program's query head
  v_all: Any  # the same of V, (kv_rows, Hv_pad)
  stat_tile: Any  # BlockSpec of a block_q slice of a (B, N, T) row statistic
  aux_specs: list  # BlockSpecs of the given lengths and segment ids
  span_specs: list  # BlockSpecs of the live key blocks (first, end), if `Aux.spans`


def query_block_launch(dims: Dims, aux: Aux, *, block_q: int, block_k: int,
                       last_first: bool) -> QueryBlockLaunch:
  """The grid (query blocks, B, N) and BlockSpecs of a query-block kernel. With
  ``last_first`` (causal masking, where a later query block walks more key blocks) the
  query blocks run last-first, so that the longest programs start first and the short
  ones fill the tail of the launch."""
  n_q_blocks = pl.cdiv(dims.T, block_q)
  q_block = (lambda i: n_q_blocks - 1 - i) if last_first else (lambda i: i)
  group = dims.N // dims.K
  kv_rows = pl.cdiv(dims.S, block_k) * block_k  # whole key blocks, for interpret mode
  q_tile = lambda width: pl.BlockSpec((None, block_q, None, width),
                                      lambda i, b, n: (b, q_block(i), n, 0))
  kv_all = lambda width: pl.BlockSpec((None, kv_rows, None, width),
                                      lambda i, b, n: (b, 0, n // group, 0))
  return QueryBlockLaunch(
      q_block=q_block,
      grid=(n_q_blocks, dims.B, dims.N),
      q_tile=q_tile(dims.H_pad), o_tile=q_tile(dims.Hv_pad),
      kv_all=kv_all(dims.H_pad), v_all=kv_all(dims.Hv_pad),
      stat_tile=pl.BlockSpec((None, None, block_q), lambda i, b, n: (b, n, q_block(i))),
      aux_specs=aux.specs(q_rows=block_q, q_index=lambda i, b, n: (b, q_block(i)),
                          kv_rows=kv_rows, kv_index=lambda i, b, n: (b, 0),
                          batch_index=lambda i, b, n: b,
                          plane_spec=lambda p: query_plane_spec(p, block_q, kv_rows, q_block),
                          slopes_spec=pl.BlockSpec((1,), lambda i, b, n: (n,))),
      span_specs=[] if aux.spans is None else 2 * [span_spec(
          aux.spans, lambda i, b, n: (b, n, q_block(i)), blocked=aux.spans.rows)])


def query_plane_spec(plane: Plane, block_q: int, kv_rows: int, q_block, *,
                     row_blocks: bool = False):
  """The BlockSpec of a mask or bias plane in a query-block kernel: the program's query
  rows (one row where T broadcasts) by every key. ``row_blocks``: dbias's partial sums,
  whose one row per query block is the program's."""
  return pl.BlockSpec(
      (None, None, block_q if plane.rows else 1, kv_rows if plane.cols else 1),
      lambda i, b, n: (b if plane.batch else 0, n if plane.heads else 0,
                       q_block(i) if plane.rows or row_blocks else 0, 0))


def load_scalar(ref):
  """A per-batch-row scalar (a length) from its (1,) block, or None without a ref."""
  return None if ref is None else jnp.max(pallas.load(ref))


def block_rows(start, rows: int, total: int):
  """Indices start + [0, rows) of a block of a sequence of length ``total``, and which
  are inside it (None when every block fits exactly)."""
  idx = start + jnp.arange(rows, dtype=jnp.int32)
  return idx, (idx < total if total % rows else None)


class QueryBlock(NamedTuple):
  """What a program that keeps a query block knows after `query_block`; the masks,
  lengths and segment ids are None where not needed or not given."""

  idx: Any  # (block_q,) row indices
  ok: Any  # (block_q,) rows inside T
  h_ok: Any  # (H_pad,) real head dims
  mask: Any  # (block_q, H_pad) load/store mask of the query tile
  o_mask: Any  # (block_q, Hv_pad) the same of an output (or dO) tile
  tile: Any  # (block_q, H_pad) the queries
  q_length: Any  # the batch row's query length
  kv_length: Any  # the batch row's key length
  segments: Any  # (block_q,) the rows' segment ids


def query_block(q_ref, aux_refs: AuxArrays, *, q0, block_q: int, dims: Dims) -> QueryBlock:
  """The prologue of a program that keeps the query block [q0, q0 + block_q) (the
  forward's and the dQ kernel's)."""
  q_idx, q_ok = block_rows(q0, block_q, dims.T)
  h_ok = dims.head_ok()
  q_mask = dims.tile_mask(q_ok, h_ok, block_q)
  o_mask = dims.tile_mask(q_ok, dims.head_ok(value=True), block_q, value=True)
  q_seg_ref = aux_refs.q_segments
  return QueryBlock(
      idx=q_idx, ok=q_ok, h_ok=h_ok, mask=q_mask, o_mask=o_mask,
      tile=pallas.load(q_ref, mask=q_mask, other=0),
      q_length=load_scalar(aux_refs.q_lengths), kv_length=load_scalar(aux_refs.kv_lengths),
      segments=None if q_seg_ref is None else pallas.load(q_seg_ref, mask=q_ok, other=-1))


class KeyBlock(NamedTuple):
  """Key block [k0, k0 + size) of a query-block kernel's walk (the forward, dQ and tangent
  kernels), after `key_block`."""

  k0: Any
  size: int  # block_k
  idx: Any  # (block_k,) key indices
  k_mask: Any  # load mask of the (block_k, H_pad) K tile; None off the boundary blocks
  v_mask: Any  # the same of the (block_k, Hv_pad) V tile
  place: dict  # where the (block_q, block_k) tile sits, as `ScoreTerms` takes it
  user_mask: Any  # the mask array's tile (`ScoreTerms.mask`), or None

  def load(self, ref, mask):
    """The block's rows of a K-side ref (K, V or their tangents)."""
    return pallas.load(ref.at[pl.ds(self.k0, self.size), :], mask=mask, other=0)

  def allowed(self, spec: MaskSpec, kv_seg_ref, block: QueryBlock) -> jax.Array:
    """The (block_q, block_k) element mask of this block for the query block ``block``
    (the boundary blocks), loading the keys' segment ids, with the mask array's tile."""
    k_segments = None
    if kv_seg_ref is not None:
      k_segments = pallas.load(kv_seg_ref.at[pl.ds(self.k0, self.size)],
                               mask=self.idx < spec.kv_len, other=-2)
    allowed = element_mask(spec, block.idx[:, None], self.idx[None, :], block.kv_length,
                           None if block.segments is None else block.segments[:, None],
                           None if k_segments is None else k_segments[None, :])
    return allowed if self.user_mask is None else allowed & self.user_mask


def key_block(k0, block_k: int, dims: Dims, terms: ScoreTerms, block: QueryBlock, *,
              masked: bool) -> KeyBlock:
  """The key block at k0 of the walk of the query block ``block``. Only boundary
  (masked) blocks can reach past S: interior blocks end before it."""
  k_idx, kv_ok = block_rows(k0, block_k, dims.S)
  rows_ok = kv_ok if masked else None
  block_q = block.idx.shape[0]
  place = dict(q_idx=block.idx, k_idx=k_idx, rows=pl.ds(0, block_q), cols=pl.ds(k0, block_k))
  return KeyBlock(k0=k0, size=block_k, idx=k_idx,
                  k_mask=dims.tile_mask(rows_ok, dims.head_ok(), block_k),
                  v_mask=dims.tile_mask(rows_ok, dims.head_ok(value=True), block_k, value=True),
                  place=place, user_mask=terms.mask((block_q, block_k), **place))


def scores(logits: Logits, a, b):
  """x for the tiles a, b (a bᵀ, float32, soft-capped), and the tanh the backward needs."""
  return logits.cap(pallas.dot(a, b, trans_b=True))


def max_or_inf(m):
  """m with -inf (no allowed key) read as +inf, so that exp(s - lse) is exactly 0."""
  return jnp.where(m == -jnp.inf, jnp.inf, m)


def probabilities(logits: Logits, exp2, x, m, log2_l, allowed):
  """P = exp(logits - lse) of a tile from the forward's statistics m (read as +inf for
  a row without keys, `max_or_inf`) and log2 l, both broadcast to x; 0 where
  ``allowed`` (None: a tile without element masks) is False."""
  p = exp2(logits.exponent_from_stats(x, m, log2_l))
  return p if allowed is None else jnp.where(allowed, p, 0.0)
