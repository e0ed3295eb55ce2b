"""Decode attention in Pallas' Triton lowering: flash-decoding over a KV cache.

One program per (split of the cache, sequence, KV head). The G = N/K query heads that
share the KV head, times the T new tokens, form one tile of T·G query rows (GQA packing:
each K/V byte is read once for all of them), padded to a power of two of at least 16
rows for the tensor cores. The program walks its split's blocks of block_k cache
positions (a contiguous cache's rows, or a paged cache's, each row's page read from the
block table), folding each into the online-softmax state (m, l) and
acc = Σ_j exp(s_j - m) v_j as the training forward does (`attention.triton.forward`),
and writes its partial o = acc / l with (m, log2 l). The split count puts every SM to
work in one wave of programs when the batch is small and the cache long. The splits
merge in float32 in a second kernel (`merge`, a program per output row), where
attention sinks join as one more part; it writes the output in its dtype and layout,
which XLA's merge needed two more passes for (1.5-4.4 us a step on the H200,
benchmarks/results/tuning/decode_merge_trial.md). One split is the result as it is
(`single_split`).

Positions at or past a sequence's length are never read: the loads of V are masked by
the length (a masked load reads nothing), and the keys there are masked to -inf by
selection, so garbage or NaN in the unused tail cannot leak into the result.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax._core.state import safe_shift
from jaxsoftmax.attention.logits import Logits, lse as natural_lse
from jaxsoftmax.attention.masks import cdiv
from jaxsoftmax.attention.triton.tiling import pow2_head_dim

__all__ = ["DecodeBlocks", "DecodeDims", "forward", "merge", "single_split"]

# Splits a merge program loads at once (a float32 (64, 128) tile is 64 registers a
# thread over 4 warps); more are merged a chunk at a time.
_MERGE_CHUNK = 64

# Blocks of cache positions a split holds at least, where the split count is ours.
_MIN_BLOCKS_PER_SPLIT = 4


# K/V bytes a streaming program keeps in flight where it has its SM to itself (four
# stages of 64 positions at head dim 128 in bfloat16).
_IN_FLIGHT_BYTES = 128 * 1024


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
  """Tiles of the Triton decode kernel (`choose` picks them for a call).

  Attributes:
    block_k: cache positions a block holds. A whole page of 256 as one block asked for
      288 KiB of shared memory at T·G = 128 rows on an H200 (which has 227 KiB), pages
      of 16 as blocks ran at half the read bandwidth of 64-position blocks
      (benchmarks/results/decode_attention.md), and blocks of 128 ran 10-20% slower than
      64 at one program per SM (benchmarks/results/tuning/tune_decode_waves2.md).
    num_stages: Triton's software-pipelining stages of the loop over the blocks (K/V
      blocks in flight per program).
    programs_per_core: where the split count is ours, the programs of one wave per SM
      that it fills (`DecodeDims.of`).
  """

  block_k: int = 64
  num_stages: int = 2
  programs_per_core: int = 3

  @classmethod
  def choose(cls, *, pairs: int, paged: bool, stage_bytes: int, cores: int):
    """The tiles for ``pairs`` (sequence, KV head) pairs over ``cores`` SMs, a stage of
    K and V blocks taking ``stage_bytes``.

    A contiguous cache whose pairs fit on the SMs streams with one program per SM and
    four stages in flight, where four stages fit in `_IN_FLIGHT_BYTES` (head dims up
    to 128 in 16 bits): on the H200, 1.5-5% faster than three programs of two stages at
    one sequence of 131072 positions, 8 of 8192 (T = 1 and 4) and 16 of 32768, and
    level with cuDNN or ahead of it (benchmarks/results/tuning/tune_decode_waves.md,
    tune_decode_waves2.md); with two stages it read at 60%. Paged caches keep three
    programs of two stages a SM: one program a SM read them at 56-62% of the bound at
    two to four stages (Triton stages no K/V load whose address waits on a page index
    through shared memory: tuning/ncu_decode_paged_t4.log) and 0-3% slower at five,
    and so do more pairs than SMs (64 sequences of 4096: one program a SM in four waves
    was 3% slower)."""
    if paged or pairs > cores or 4 * stage_bytes > _IN_FLIGHT_BYTES:
      return cls()
    return cls(num_stages=4, programs_per_core=1)

  def __post_init__(self):
    for name, least in (("block_k", 16), ("num_stages", 1), ("programs_per_core", 1)):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= least):
        raise ValueError(f"DecodeBlocks.{name} must be an int >= {least}, got {value!r}")
    if self.block_k & (self.block_k - 1):
      raise ValueError(f"DecodeBlocks.block_k must be a power of two, got {self.block_k}")


@dataclasses.dataclass(frozen=True)
class DecodeDims:
  """The problem: B sequences of T new tokens, N query heads over K KV heads of dim H;
  S cache positions per sequence (contiguous: the cache's length; paged: the block
  table's pages times page_size). The kernel walks blocks of ``tiles.block_k``
  consecutive positions of a sequence; in a paged cache each position's page comes from
  the block table (one page for the whole block where the page size is a multiple of
  the block).
  Each sequence's blocks below its length are cut into ``splits`` runs of one size at
  run time, so that a short sequence in a long cache is spread over every split too."""

  B: int
  T: int
  N: int
  K: int
  H: int
  S: int
  page_size: int | None  # None: a contiguous cache
  pages: int  # pages in the pool (paged), else 0
  splits: int
  tiles: DecodeBlocks = DecodeBlocks()

  @property
  def G(self) -> int:
    return self.N // self.K

  @property
  def rows(self) -> int:
    return self.T * self.G

  @property
  def rows_pad(self) -> int:
    return max(16, pl.next_power_of_2(self.rows))

  @property
  def H_pad(self) -> int:
    return pow2_head_dim(self.H)

  @property
  def num_warps(self) -> int:
    """4 warps, or 8 where the float32 accumulator (rows x head dim) would otherwise
    take more than 64 registers a thread (T·G = 128 rows at head dim 128, 64 at 256)."""
    return 4 if self.rows_pad * self.H_pad <= 4 * 32 * 64 else 8

  @property
  def gathers_pages(self) -> bool:
    """Whether a block's positions lie in more than one page (paged, with a page size
    that is not a multiple of the block)."""
    return self.page_size is not None and self.page_size % self.tiles.block_k != 0

  @property
  def blocks(self) -> int:
    return pl.cdiv(self.S, self.tiles.block_k)

  @classmethod
  def of(cls, query, key, block_table, num_splits: int | None, *, cores: int,
         tiles: DecodeBlocks | None = None):
    B, T, N, H = query.shape
    K = key.shape[2]
    if block_table is None:
      page_size, pages, S = None, 0, key.shape[1]
    else:
      page_size, pages = key.shape[1], key.shape[0]
      S = block_table.shape[1] * page_size
    if tiles is None:
      stage_bytes = 2 * DecodeBlocks.block_k * pow2_head_dim(H) * query.dtype.itemsize
      tiles = DecodeBlocks.choose(pairs=B * K, paged=block_table is not None,
                                  stage_bytes=stage_bytes, cores=cores)
    dims = cls(B, T, N, K, H, S, page_size, pages, 1, tiles)
    if num_splits is None:  # one wave of a few programs per SM, each a few blocks at least
      one_wave = (tiles.programs_per_core * cores) // (B * K)  # splits filling one wave
      num_splits = max(1, min(one_wave, dims.blocks // _MIN_BLOCKS_PER_SPLIT))
    return dataclasses.replace(dims, splits=min(num_splits, dims.blocks))


def _kernel(q_ref, k_ref, v_ref, len_ref, *refs, dims: DecodeDims, logits: Logits,
            window_left: int | None, exp2):
  bt_ref = refs[0] if dims.page_size is not None else None
  o_ref, m_ref, log2_l_ref = refs[-3:]
  split = pl.program_id(0)
  R, bk = dims.rows_pad, dims.tiles.block_k
  length = jnp.max(pallas.load(len_ref))
  r = jnp.arange(R, dtype=jnp.int32)
  row_ok = r < dims.rows
  h_ok = None if dims.H_pad == dims.H else jnp.arange(dims.H_pad, dtype=jnp.int32) < dims.H
  tile_mask = row_ok[:, None] if h_ok is None else row_ok[:, None] & h_ok[None, :]
  q = pallas.load(q_ref, mask=tile_mask, other=0)
  pos = length - dims.T + r // dims.G  # each row's position in its sequence
  # The split's run of the blocks that hold a position below the length, cut by the
  # length (not the cache's capacity); with a window, only those at or after the
  # earliest position a row sees.
  n_blocks = cdiv(length, bk)
  chunk = cdiv(n_blocks, dims.splits)
  lo = split * chunk
  hi = jnp.minimum(lo + chunk, n_blocks)
  if window_left is not None:
    lo = jnp.maximum(lo, jnp.maximum(length - dims.T - window_left, 0) // bk)
  i = jnp.arange(bk, dtype=jnp.int32)

  # Positions below the length (and the cache's end, which an unchecked length inside
  # jit could pass) are the only ones loaded.
  end = jnp.minimum(length, dims.S)

  def tiles(j, used):
    """The refs of block j's K and V rows. A page index outside the pool is clamped into
    it, never read outside."""
    if bt_ref is None:
      return k_ref.at[pl.ds(j * bk, bk), :], v_ref.at[pl.ds(j * bk, bk), :]
    page_size = dims.page_size
    if not dims.gathers_pages:  # the block lies in one page
      slot = (j * bk) // page_size
      page = jnp.clip(jnp.max(pallas.load(bt_ref.at[pl.ds(slot, 1)])), 0, dims.pages - 1)
      offset = pl.ds((j * bk) % page_size, bk)
      return k_ref.at[page, offset, :], v_ref.at[page, offset, :]
    s = j * bk + i  # each row's own page and place in it
    page = pallas.load(bt_ref.at[s // page_size], mask=used, other=0)
    # Every index a (block_k, H) array: Pallas' interpreter gathers no mix of arrays and
    # slices.
    rows = lambda a: jnp.broadcast_to(a[:, None], (bk, dims.H_pad))
    index = (rows(jnp.clip(page, 0, dims.pages - 1)), rows(s % page_size),
             jnp.broadcast_to(jnp.arange(dims.H_pad, dtype=jnp.int32)[None, :],
                              (bk, dims.H_pad)))
    return k_ref.at[index], v_ref.at[index]

  def block(j, carry):
    m, l, acc = carry
    s = j * bk + i  # the block's positions
    used = s < end
    k_blk, v_blk = tiles(j, used)
    kv_mask = used[:, None] if h_ok is None else used[:, None] & h_ok[None, :]
    k = pallas.load(k_blk, mask=kv_mask, other=0)
    x, _ = logits.cap(pallas.dot(q, k, trans_b=True))  # (R, bk)
    allowed = (s[None, :] <= pos[:, None]) & row_ok[:, None]  # pos < length
    if window_left is not None:
      allowed = allowed & (s[None, :] >= pos[:, None] - window_left)
    x = jnp.where(allowed & used[None, :], x, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(x, axis=1))
    shift = safe_shift(m_new)
    p = exp2(logits.exponent(x, shift[:, None]))
    alpha = exp2(logits.exponent(m, shift))
    v = pallas.load(v_blk, mask=kv_mask, other=0)
    acc = acc * alpha[:, None] + pallas.dot(p.astype(v.dtype), v)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc

  carry = (jnp.full((R,), -jnp.inf, jnp.float32), jnp.zeros((R,), jnp.float32),
           jnp.zeros((R, dims.H_pad), jnp.float32))
  m, l, acc = lax.fori_loop(lo, jnp.maximum(hi, lo), block, carry)
  some = l != 0  # NaN stays NaN (NaN != 0)
  l_safe = jnp.where(some, l, 1.0)
  o = jnp.where(some[:, None], acc / l_safe[:, None], 0.0)
  pallas.store(o_ref, o.astype(o_ref.dtype), mask=tile_mask)
  pallas.store(m_ref, jnp.where(some, jnp.where(l == l, m, jnp.nan), -jnp.inf), mask=row_ok)
  pallas.store(log2_l_ref, jnp.log2(l_safe), mask=row_ok)


def forward(q, k, v, lengths, block_table, *, dims: DecodeDims, scale: float,
            softcap: float | None, window_left: int | None, interpret: bool,
            o_dtype=jnp.float32):
  """Per split: o (splits, B, K, T·G, H) in ``o_dtype`` (float32 where the splits merge;
  the output's dtype where one split is the result), m and log2 l (splits, B, K, T·G)
  float32, for q (B, T, N, H) and the cache k, v (contiguous (B, S, K, H), or pools
  (pages, page_size, K, H) with ``block_table`` (B, max_pages)); ``lengths`` and the
  table int32."""
  B, T, N, H = q.shape
  K, G, R, R_pad, H_pad = dims.K, dims.G, dims.rows, dims.rows_pad, dims.H_pad
  # Rows (t, g) of each KV head's tile: a transpose of the few new tokens only.
  q_rows = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, R, H)
  q_spec = pl.BlockSpec((None, None, R_pad, H_pad), lambda s, b, h: (b, h, 0, 0))
  if block_table is None:
    kv_spec = pl.BlockSpec((None, dims.blocks * dims.tiles.block_k, None, H_pad),
                           lambda s, b, h: (b, 0, h, 0))
  else:
    kv_spec = pl.BlockSpec((k.shape[0], k.shape[1], None, H_pad),
                           lambda s, b, h: (0, 0, h, 0))
  in_specs = [q_spec, kv_spec, kv_spec, pl.BlockSpec((1,), lambda s, b, h: (b,))]
  args = [q_rows, k, v, lengths]
  if block_table is not None:
    in_specs.append(pl.BlockSpec((None, block_table.shape[1]), lambda s, b, h: (b, 0)))
    args.append(block_table)
  o_spec = pl.BlockSpec((None, None, None, R_pad, H_pad), lambda s, b, h: (s, b, h, 0, 0))
  stat_spec = pl.BlockSpec((None, None, None, R_pad), lambda s, b, h: (s, b, h, 0))
  stat = jax.ShapeDtypeStruct((dims.splits, B, K, R), jnp.float32)
  logits = Logits(scale, softcap, fused=q.dtype != jnp.float32)
  kernel = functools.partial(_kernel, dims=dims, logits=logits, window_left=window_left,
                             exp2=pallas.exp2(interpret))
  return pallas.pallas_call(
      kernel, name="decode_attention", grid=(dims.splits, B, K), in_specs=in_specs,
      out_specs=[o_spec, stat_spec, stat_spec],
      out_shape=[jax.ShapeDtypeStruct((dims.splits, B, K, R, H), o_dtype), stat, stat],
      num_warps=dims.num_warps, num_stages=dims.tiles.num_stages,
      interpret=interpret)(*args)


def single_split(o, m, log2_l, *, dims: DecodeDims, scale: float, softcap: float | None,
                 out_dtype):
  """The result where one split holds every position and there are no sinks: the
  kernel's o and (m, log2 l) as (out (B, T, N, H) in ``out_dtype``, lse (B, T, N)
  float32), the rows (t, g) of each KV head moved to their places (no move at T = 1).
  The merge would weigh the one part by 1, or by 0 for a row with no position, whose o
  the kernel wrote as 0 already."""
  B, T, K, G, H = dims.B, dims.T, dims.K, dims.G, dims.H
  lse = natural_lse(m[0], log2_l[0], scale=scale, softcap=softcap)
  out = o[0].astype(out_dtype)
  out = out.reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, K * G, H)
  return out, lse.reshape(B, K, T, G).transpose(0, 2, 1, 3).reshape(B, T, K * G)


def _merge_kernel(o_ref, m_ref, log2_l_ref, *refs, splits: int, H: int, scale: float,
                  softcap: float | None):
  """One row (sequence b, KV head k, row r = (t, g)) of the merge: the splits' partial
  (o, lse) folded a chunk at a time into a running (max lse, Σ exp(lse - max),
  Σ exp(lse - max)·o), which starts from the row's sink where there is one (a part
  whose output is 0, docs/math.md, "Attention sinks")."""
  sink_ref = refs[0] if len(refs) == 3 else None
  out_ref, lse_ref = refs[-2:]
  H_pad = o_ref.shape[-1]
  C = min(o_ref.shape[0], _MERGE_CHUNK)
  h_ok = jnp.arange(H_pad, dtype=jnp.int32) < H

  def chunk(c, carry):
    mx, total, acc = carry
    ok = c * C + jnp.arange(C, dtype=jnp.int32) < splits
    m = pallas.load(m_ref.at[pl.ds(c * C, C)], mask=ok, other=-jnp.inf)
    log2_l = pallas.load(log2_l_ref.at[pl.ds(c * C, C)], mask=ok, other=0.0)
    lse = natural_lse(m, log2_l, scale=scale, softcap=softcap)
    o = pallas.load(o_ref.at[pl.ds(c * C, C), :], mask=ok[:, None] & h_ok[None, :],
                    other=0.0)
    m_new = jnp.maximum(mx, jnp.max(lse))
    shift = safe_shift(m_new)
    w = jnp.exp(lse - shift)  # 0 for an empty split (lse = -inf) and past the splits
    alpha = jnp.exp(mx - shift)
    return m_new, total * alpha + jnp.sum(w), acc * alpha + jnp.sum(w[:, None] * o, axis=0)

  if sink_ref is None:
    start = (jnp.float32(-jnp.inf), jnp.float32(0.0))
  else:
    sink = jnp.max(pallas.load(sink_ref))
    start = (sink, jnp.exp(sink - safe_shift(sink)))
  mx, total, acc = lax.fori_loop(0, pl.cdiv(splits, C), chunk,
                                 (*start, jnp.zeros((H_pad,), jnp.float32)))
  some = total != 0  # a row with no part gives 0; NaN stays NaN (NaN != 0)
  out = jnp.where(some, acc / jnp.where(some, total, 1.0), 0.0)
  pallas.store(out_ref, out.astype(out_ref.dtype), mask=h_ok)
  pallas.store(lse_ref, jnp.full((1,), safe_shift(mx) + jnp.log(total), jnp.float32))


def merge(o, m, log2_l, *, dims: DecodeDims, scale: float, softcap: float | None,
          sinks=None, out_dtype, interpret: bool):
  """The splits' partial results (o (splits, B, K, rows, H) float32, m and log2 l
  (splits, B, K, rows), rows >= T·G) merged in float32 in one kernel, a program per
  output row: (out (B, T, N, H) in ``out_dtype``, written in that layout at once; lse
  (B, T, N) float32, -inf for a row with no position). ``sinks``: None, or (B, N)
  logits, one per query head (attention sinks, docs/math.md), each one more part whose
  output is 0, so that a row with no position gives out 0 and lse = its sink."""
  B, T, K, G, H = dims.B, dims.T, dims.K, dims.G, dims.H
  splits, H_pad = o.shape[0], dims.H_pad
  S_pad = pl.next_power_of_2(splits)
  rows = lambda b, k, r: (b, r // G, k, r % G)  # row r = (t, g) of KV head k's tile
  in_specs = [
      pl.BlockSpec((S_pad, None, None, None, H_pad), lambda b, k, r: (0, b, k, r, 0)),
      pl.BlockSpec((S_pad, None, None, None), lambda b, k, r: (0, b, k, r)),
      pl.BlockSpec((S_pad, None, None, None), lambda b, k, r: (0, b, k, r))]
  args = [o, m, log2_l]
  if sinks is not None:
    in_specs.append(pl.BlockSpec((None, None, 1), lambda b, k, r: (b, k, r % G)))
    args.append(sinks.astype(jnp.float32).reshape(B, K, G))
  kernel = functools.partial(_merge_kernel, splits=splits, H=H, scale=scale,
                             softcap=softcap)
  out, lse = pallas.pallas_call(
      kernel, name="decode_attention_merge", grid=(B, K, T * G), in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, None, None, None, H_pad),
                              lambda b, k, r: (*rows(b, k, r), 0)),
                 pl.BlockSpec((None, None, None, 1), rows)],
      out_shape=[jax.ShapeDtypeStruct((B, T, K, G, H), out_dtype),
                 jax.ShapeDtypeStruct((B, T, K, G), jnp.float32)],
      num_warps=4 if min(S_pad, _MERGE_CHUNK) * H_pad <= 64 * 128 else 8, num_stages=1,
      interpret=interpret)(*args)
  return out.reshape(B, T, K * G, H), lse.reshape(B, T, K * G)
