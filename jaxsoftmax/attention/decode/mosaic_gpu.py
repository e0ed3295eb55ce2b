"""Decode attention for Hopper GPUs in Pallas Mosaic GPU: flash-decoding with TMA streaming.

The work items are (split of the cache, sequence b, KV head h), as in the Triton kernel
(`decode.triton`): the G = N/K query heads of the KV head, times the T new tokens, form
one tile of T·G <= 64 query rows (row r = t·G + g), padded to the 64 rows of a wgmma
tile, so that each K/V byte is read once for all of them. A sequence's blocks of
``block_k`` positions below its length are cut into ``splits`` runs of one size at run
time (`DecodeDims`), and the splits' partial results merge in float32 in the Triton
merge kernel (`triton.merge`): the kernel writes the same per-split (o, m, log2 l) as
the Triton kernel, with rows of padding past T·G.

Each CTA has two warpgroups, a producer and a consumer:

- the producer (the last warpgroup) streams the item's K and V blocks by TMA into a ring of
  ``num_stages`` shared-memory slots, each with a "loaded" barrier that the copies
  complete and a "free" barrier that the block's consumer arrives on. A contiguous cache's
  block is one copy; a paged cache's is one copy from the page the block table names
  where the page size is a multiple of ``block_k``, else block_k / page_size copies of
  whole pages into row slices of the slot, all completing the slot's barrier. Page
  indices are read from the block table in global memory and clamped into the pool;
- a consumer computes x = q kᵀ by wgmma into float32 registers, the
  online-softmax update with the scale folded into the base-2 exponent
  (`logits.Logits`), and acc += p v by wgmma with p from registers. Element masks
  (causal among the new tokens, the window) apply only to the blocks that need them
  (`masks.walk_block_ranges`).

With ``persistent`` (the default) one CTA per SM walks the items i, i + SMs, ..., its
ring running on from one item into the next, so that no SM's copies stop between items;
otherwise one CTA per item.

Positions at or past a sequence's length are never read into the result: TMA reads
whole blocks, so the keys there are masked to -inf, and on the block that holds the
length the consumer zeroes the V rows at or past it in shared memory before the P V
product (0 · NaN would be NaN); garbage or NaN in the unused tail cannot leak.

It has no interpret mode (see `jaxsoftmax._core.mosaic_gpu`), and takes bfloat16 and
float16 caches with head dims 64, 128, 192 or 256; `unsupported` says why a call is
left to the Triton kernel.

Status: on the H200 (JAX 0.11.2) it passes its GPU tests (tests/test_decode_attention.py,
35 GPU-marked cases: contiguous and paged at every page size, soft cap, window, T up to
16, NaN in and past the cache, persistent and grid launches) and reads at 89-97% of the
read bound. Beside the Triton kernel it is faster at T = 4 (70.5 against 73.2 us,
8 x 8192) and on one long sequence (132 against 136 us, 1 x 131072) and slower on large
batches (259 against 242 us at 64 x 4096, 484 against 470 at 16 x 32768;
benchmarks/results/decode_attention.md), so `api.HOPPER_BY_DEFAULT` keeps the default
on the Triton kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax._core import mosaic_gpu as _device
from jaxsoftmax._core.mosaic_gpu import (SMEM_BYTES, div32, pad_to, per_row, pl, plgpu,
                                        rem32, warp_specialized_kernel, wgmma_iota)
from jaxsoftmax.attention.decode.triton import DecodeDims
from jaxsoftmax.attention.logits import Logits
from jaxsoftmax.attention.masks import cdiv, walk_block_ranges

__all__ = ["NAME", "HopperDecodeBlocks", "Plan", "unsupported", "plan", "forward",
           "choose_splits"]

NAME = "mosaic_gpu"
DTYPES = ("bfloat16", "float16")
MAX_HEAD_DIM = 256
# Query rows of a CTA: one wgmma tile (the T·G rows of a KV head, padded).
ROWS = 64
# Smallest page a paged cache may have here: each page is one TMA copy of whole
# (8, 64) tiles of the swizzled shared-memory layout.
MIN_PAGE = 16
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per query row
# Output columns that leave through shared memory at a time.
_CHUNK = 64
# One consumer warpgroup: each ring slot's barriers then complete phases that one
# waiter tracks. A first H200 run with two consumers taking blocks in turn failed on
# long caches, where a slot's barrier completed phases its consumer of the moment had
# not waited for (two would need the slots split between them).
# Where the split count is ours: a split holds this many blocks at least, and each
# work item costs about this many blocks' time beyond its blocks (its query tile, its
# outputs, the merge).
_MIN_BLOCKS_PER_SPLIT = 4
_ITEM_OVERHEAD_BLOCKS = 1


@dataclasses.dataclass(frozen=True)
class HopperDecodeBlocks:
  """Tiles of the Hopper decode kernel.

  Attributes:
    block_k: cache positions per K/V block streamed through shared memory.
    num_stages: K/V blocks in flight (slots of the shared-memory ring).
    persistent: one CTA per SM walking the work items, instead of one CTA per item.
  """

  block_k: int = 64
  num_stages: int = 5
  persistent: bool = True

  def __post_init__(self):
    if not (isinstance(self.block_k, int) and self.block_k > 0 and self.block_k % 64 == 0):
      raise ValueError(f"HopperDecodeBlocks.block_k must be a positive multiple of 64, got "
                       f"{self.block_k!r}")
    if not (isinstance(self.num_stages, int) and self.num_stages >= 2):
      raise ValueError(f"HopperDecodeBlocks.num_stages must be an int >= 2, got "
                       f"{self.num_stages!r}")

  @classmethod
  def default(cls, head_dim: int, itemsize: int = 2) -> "HopperDecodeBlocks":
    """Blocks of 64 positions (128 at head dim 64), and as many stages as shared memory
    holds beside the query and output tiles, 5 at most (at head dim 128: 5 slots of 32
    KiB, 2 at head dim 256)."""
    blocks = cls(128 if head_dim <= 64 else 64, 5)
    while blocks.num_stages > 2 and blocks.smem_bytes(head_dim, itemsize) > SMEM_BYTES:
      blocks = dataclasses.replace(blocks, num_stages=blocks.num_stages - 1)
    return blocks

  def smem_bytes(self, head_dim: int, itemsize: int) -> int:
    """Shared memory at this head dim: the query tile, the K and V ring, the float32
    output chunk and statistics, and 1 KiB for the barriers and alignment."""
    return ((ROWS + 2 * self.num_stages * self.block_k) * head_dim * itemsize
            + ROWS * _CHUNK * 4 + 2 * ROWS * 4 + 1024)


@dataclasses.dataclass(frozen=True)
class Plan:
  """One call's problem (`DecodeDims`, its split count ours or the caller's) and tiles."""

  dims: DecodeDims
  blocks: HopperDecodeBlocks
  cores: int

  @property
  def block_k(self) -> int:
    return self.blocks.block_k

  @property
  def rows_out(self) -> int:
    """Rows of each item's output: T·G, padded to whole 8-row tiles."""
    return -(-self.dims.rows // 8) * 8

  @property
  def copies(self) -> int:
    """TMA copies per K (and per V) block: whole pages where pages are smaller than a
    block, else one."""
    page = self.dims.page_size
    return 1 if page is None or page >= self.block_k else self.block_k // page

  @property
  def items(self) -> int:
    return self.dims.splits * self.dims.B * self.dims.K

  @property
  def ctas(self) -> int:
    return min(self.cores, self.items) if self.blocks.persistent else self.items


def choose_splits(pairs: int, blocks: int, cores: int) -> int:
  """The split count for ``pairs`` (sequence, KV head) pairs of ``blocks`` blocks each
  over ``cores`` SMs: the one with the least time in a model of rounds of one item per
  SM (a round as long as its items' blocks plus an item's overhead), counting only the
  splits that get blocks (runs of cdiv(blocks, s) blocks), each split holding a few
  blocks at least; ties go to fewer splits."""
  best, best_cost = 1, None
  for s in range(1, max(1, blocks // _MIN_BLOCKS_PER_SPLIT) + 1):
    chunk = pl.cdiv(blocks, s)
    used = pl.cdiv(blocks, chunk)
    cost = pl.cdiv(pairs * used, cores) * (chunk + _ITEM_OVERHEAD_BLOCKS)
    if best_cost is None or cost < best_cost:
      best, best_cost = s, cost
  return best


def _shape_of(query, key, block_table):
  B, T, N, H = query.shape
  K = key.shape[2]
  if block_table is None:
    return B, T, N, K, H, key.shape[1], None, 0
  page_size, pages = key.shape[1], key.shape[0]
  return B, T, N, K, H, block_table.shape[1] * page_size, page_size, pages


def unsupported(query, key, block_table, *, interpret: bool = False,
                blocks: HopperDecodeBlocks | None = None) -> str | None:
  """Why this kernel cannot run a call on these arrays (or shape structs), or None when
  it can."""
  if not _device.hopper_device():
    return ("it needs a Hopper GPU (compute capability 9.x); the default device is "
            f"{_device.device_description()}")
  if interpret:
    return "it has no interpret mode (interpret=True, or JAXSOFTMAX_INTERPRET=1)"
  B, T, N, K, H, S, page_size, _ = _shape_of(query, key, block_table)
  dtype = jnp.dtype(query.dtype).name
  if dtype not in DTYPES:
    return f"it takes bfloat16 or float16 inputs, got {dtype}"
  if H % 64 or H > MAX_HEAD_DIM:
    return (f"head dims of multiples of 64 up to {MAX_HEAD_DIM} (whole 128-byte swizzled "
            f"tiles), got {H}")
  if T * (N // K) > ROWS:
    return (f"the T·G = {T}·{N // K} = {T * (N // K)} query rows of a KV head must fit "
            f"one {ROWS}-row tile")
  blocks = blocks or HopperDecodeBlocks.default(H, query.dtype.itemsize)
  bk = _block_k(blocks, S, page_size)
  if page_size is None:
    # TMA moves whole 8-row tiles of the shared-memory layout: padding the cache's
    # length would copy the cache.
    if S < bk or S % 8:
      return (f"a contiguous cache of a multiple of 8 positions, {bk} at least, got {S}")
  elif page_size < MIN_PAGE or (page_size % bk and bk % page_size):
    return (f"page sizes that divide the {bk}-position block or are multiples of it, "
            f"{MIN_PAGE} at least, got {page_size}")
  needed = blocks.smem_bytes(H, query.dtype.itemsize)
  if needed > SMEM_BYTES:
    return (f"{blocks} need {needed} bytes of shared memory at head dim {H}, more than "
            f"the {SMEM_BYTES} a block may use")
  return None


def _block_k(blocks: HopperDecodeBlocks, S: int, page_size: int | None) -> int:
  """The block: the tiles', or 64 for a contiguous cache shorter than it."""
  if page_size is None and S < blocks.block_k:
    return 64
  return blocks.block_k


def plan(query, key, block_table, num_splits: int | None, *, cores: int,
         blocks: HopperDecodeBlocks | None = None) -> Plan:
  """The call's `Plan`: the split count is ``num_splits`` (at most one per block), else
  `choose_splits`."""
  B, T, N, K, H, S, page_size, pages = _shape_of(query, key, block_table)
  blocks = blocks or HopperDecodeBlocks.default(H, query.dtype.itemsize)
  blocks = dataclasses.replace(blocks, block_k=_block_k(blocks, S, page_size))
  n_blocks = pl.cdiv(S, blocks.block_k)
  if num_splits is None:
    num_splits = choose_splits(B * K, n_blocks, cores)
  dims = DecodeDims(B, T, N, K, H, S, page_size, pages, min(num_splits, n_blocks))
  return Plan(dims, blocks, cores)




@dataclasses.dataclass(frozen=True)
class _Items:
  """The work items (split, b, h), KV heads fastest, then splits, then sequences (the
  splits of a sequence's heads go to different CTAs), and the CTAs that take them."""

  splits: int
  heads: int
  count: int
  ctas: int
  persistent: bool

  def grid(self):
    return ((self.ctas,), ("sm",)) if self.persistent else ((self.count,), ("items",))

  def item(self, w):
    h, rest = rem32(w, self.heads), div32(w, self.heads)
    return rem32(rest, self.splits), div32(rest, self.splits), h

  def for_each(self, body, carry):
    """carry = body(i, (split, b, h), carry) over the CTA's items, i counting them."""
    if not self.persistent:
      return body(0, self.item(lax.axis_index("items")), carry)
    cta = lax.axis_index("sm")
    n = div32(self.count - cta + (self.ctas - 1), self.ctas)
    return lax.fori_loop(0, n, lambda i, c: body(i, self.item(i * self.ctas + cta), c),
                         carry)


class _Scratch(NamedTuple):
  """The kernel's shared memory and barriers, by name (`forward` allocates them in the
  order it lists them)."""

  q_smem: Any  # the item's query tile
  k_smem: Any  # the K ring
  v_smem: Any  # the V ring
  o_smem: Any  # 64 columns of the item's float32 output on their way out
  stat_smem: Any  # m and log2(l) on their way out
  q_loaded: Any
  q_free: Any
  k_loaded: Any
  v_loaded: Any
  k_free: Any
  v_free: Any


def _kernel(q_ref, k_ref, v_ref, len_ref, *refs, plan: Plan, logits: Logits,
            window_left: int | None, scratch_names: tuple[str, ...]):
  dims = plan.dims
  paged = dims.page_size is not None
  bt_ref, refs = (refs[0], refs[1:]) if paged else (None, refs)
  o_ref, m_ref, log2_l_ref, *refs = refs
  sc = _Scratch(**dict(zip(scratch_names, refs, strict=True)))
  bk, stages, G = plan.block_k, plan.blocks.num_stages, dims.G
  items = _Items(dims.splits, dims.K, plan.items, plan.ctas, plan.blocks.persistent)
  wg = lax.axis_index("wg")

  def ranges(split, b):
    """(length, lo, hi): the sequence's length (clamped into the cache) and its split's
    run of blocks [lo, hi), cut from the blocks below the length (with a window, from
    those at or after the earliest position a row sees). Producer and consumer agree."""
    length = jnp.minimum(jnp.maximum(len_ref[b], 0), dims.S)
    n_blocks = cdiv(length, bk)
    chunk = cdiv(n_blocks, dims.splits)
    lo = split * chunk
    hi = jnp.minimum(lo + chunk, n_blocks)
    if window_left is not None:
      lo = jnp.maximum(lo, div32(jnp.maximum(length - dims.T - window_left, 0), bk))
    return length, lo, jnp.maximum(hi, lo)

  @pl.when(wg == 0)
  def _consumer():
    shape = (ROWS, bk)
    o_smem, stat_smem = sc.o_smem, sc.stat_smem

    def item_body(_, item, consumed):
      split, b, h = item
      length, lo, hi = ranges(split, b)
      base = length - dims.T  # the position of the first new token
      # Blocks every row sees whole: none of their positions past the first new token,
      # none before the latest window start of a row.
      full_lo = lo
      if window_left is not None:
        full_lo = cdiv(jnp.maximum(length - 1 - window_left, 0), bk)
      full_lo = jnp.minimum(jnp.maximum(full_lo, lo), hi)
      full_hi = jnp.minimum(jnp.maximum(div32(jnp.maximum(base + 1, 0), bk), full_lo), hi)

      def slot(j):  # the ring runs on across the CTA's items
        return rem32(consumed + j - lo, stages)

      def step(j, carry, *, masked: bool):
        acc, m, l = carry
        s = slot(j)
        plgpu.barrier_wait(sc.k_loaded.at[s])

        def scores(acc_ref):
          plgpu.wgmma(acc_ref, sc.q_smem, sc.k_smem.at[s].T)
          return acc_ref[...]

        x = pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))
        plgpu.barrier_arrive(sc.k_free.at[s])
        x, _ = logits.cap(x)
        if masked:
          # Row r = t·G + g sits at base + t: it sees position p when p - base <= t,
          # i.e. (p - base)·G <= r, and with a window p >= base + t - w, i.e.
          # r < (p - base + w + 1)·G.
          ahead = j * bk + wgmma_iota(shape, 1) - base
          r = wgmma_iota(shape, 0)
          allowed = ahead * G <= r
          if window_left is not None:
            allowed = allowed & (r < (ahead + (window_left + 1)) * G)
          x = jnp.where(allowed, x, -jnp.inf)
        m_new = jnp.maximum(m, x.max(axis=1))
        # A row with no allowed position so far keeps m = -inf; shifting it by 0 keeps
        # its p and alpha at 0 instead of NaN. Unmasked blocks hold one for every row.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(logits.exponent(m, shift))
        p = jnp.exp2(logits.exponent(x, shift, functools.partial(per_row, shape=shape)))
        l = l * alpha + p.sum(axis=1)
        acc = acc * per_row(alpha, acc.shape)
        p16 = p.astype(sc.v_smem.dtype)
        plgpu.barrier_wait(sc.v_loaded.at[s])
        if masked:
          @pl.when((j + 1) * bk > length)
          def _():
            # The block holding the length: its V rows at or past it may be garbage or
            # NaN, which a zero probability would not cancel.
            tile = sc.v_smem.at[s]
            v = tile[...]
            tile[...] = jnp.where(wgmma_iota(v.shape, 0) < length - j * bk, v,
                                  jnp.zeros_like(v))
            plgpu.commit_smem()

        def values(acc_ref):
          plgpu.wgmma(acc_ref, p16, sc.v_smem.at[s])

        acc = pl.run_state(values)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(sc.v_free.at[s])
        return acc, m_new, l

      plgpu.barrier_wait(sc.q_loaded)
      m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), _ROW)
      l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), _ROW)
      acc = plgpu.layout_cast(jnp.zeros((ROWS, dims.H), jnp.float32), plgpu.Layout.WGMMA)
      acc, m, l = walk_block_ranges((lo, full_lo, full_hi, hi), step, (acc, m, l))
      plgpu.barrier_arrive(sc.q_free)  # no product reads it any more

      # Rows with no allowed position (l = 0) give 0; a NaN l stays NaN (NaN != 0).
      some = l != 0
      inv_l = jnp.where(some, 1.0 / jnp.where(some, l, 1.0), 0.0)
      o = acc * per_row(inv_l, acc.shape)
      rows = pl.ds(0, plan.rows_out)
      for c in range(dims.H // _CHUNK):  # 64 columns at a time through shared memory
        columns = pl.ds(c * _CHUNK, _CHUNK)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk has left
        o_smem[...] = o[:, c * _CHUNK:(c + 1) * _CHUNK]
        if c == 0:
          # A NaN l makes m NaN too (the GPU's max skips NaN), as the Triton kernel
          # writes it.
          stat_smem.at[0][...] = jnp.where(some, jnp.where(l == l, m, jnp.nan), -jnp.inf)
          stat_smem.at[1][...] = jnp.log2(jnp.where(some, l, 1.0))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[split, b, h, :, columns])
        if c == 0:
          plgpu.copy_smem_to_gmem(stat_smem.at[0], m_ref.at[split, b, h])
          plgpu.copy_smem_to_gmem(stat_smem.at[1], log2_l_ref.at[split, b, h])
      return consumed + (hi - lo)

    items.for_each(item_body, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _producer():
    max_pages = 0 if not paged else dims.S // dims.page_size

    def page(b, index):
      """Page ``index`` of sequence b, both clamped: past the table (positions past the
      cache's end, which are masked) to its last entry, the page into the pool."""
      entry = bt_ref[b, jnp.minimum(index, max_pages - 1)]
      return jnp.minimum(jnp.maximum(entry, 0), dims.pages - 1)

    def sources(b, h, j):
      """(K source, V source, slot rows) of each copy of block j."""
      if not paged:
        rows = (b, pl.ds(j * bk, bk), h)
        return [(k_ref.at[rows], v_ref.at[rows], None)]
      page_size = dims.page_size
      if plan.copies == 1:  # the block lies in one page
        start = j * bk
        rows = (page(b, div32(start, page_size)), pl.ds(rem32(start, page_size), bk), h)
        return [(k_ref.at[rows], v_ref.at[rows], None)]
      out = []
      for c in range(plan.copies):  # whole pages into row slices of the slot
        rows = (page(b, j * plan.copies + c), slice(None), h)
        out.append((k_ref.at[rows], v_ref.at[rows], pl.ds(c * page_size, page_size)))
      return out

    def item_body(i, item, issued):
      split, b, h = item
      _, lo, hi = ranges(split, b)

      def load_kv(j):
        g = issued + j - lo  # the ring starts empty: its first loads wait for no slot
        s = rem32(g, stages)
        copies = sources(b, h, j)  # the page indices are read before the waits
        pl.when(g >= stages)(lambda: plgpu.barrier_wait(sc.k_free.at[s]))
        for k_src, _, rows in copies:
          dst = sc.k_smem.at[s] if rows is None else sc.k_smem.at[s, rows]
          plgpu.copy_gmem_to_smem(k_src, dst, sc.k_loaded.at[s])
        pl.when(g >= stages)(lambda: plgpu.barrier_wait(sc.v_free.at[s]))
        for _, v_src, rows in copies:
          dst = sc.v_smem.at[s] if rows is None else sc.v_smem.at[s, rows]
          plgpu.copy_gmem_to_smem(v_src, dst, sc.v_loaded.at[s])

      # The item's first K/V block may go as soon as a slot is free; its query tile
      # waits until the previous item's products are done with it.
      pl.when(lo < hi)(functools.partial(load_kv, lo))
      pl.when(i > 0)(lambda: plgpu.barrier_wait(sc.q_free))
      plgpu.copy_gmem_to_smem(q_ref.at[b, h], sc.q_smem, sc.q_loaded)
      pl.loop(lo + 1, hi)(load_kv)
      return issued + (hi - lo)

    items.for_each(item_body, jnp.int32(0))


def forward(q, k, v, lengths, block_table, *, plan: Plan, scale: float,
            softcap: float | None, window_left: int | None):
  """Per split, float32: o (splits, B, K, rows, H), m and log2 l (splits, B, K, rows),
  as `triton.forward` writes them but for rows >= T·G of padding, for q
  (B, T, N, H) and the cache k, v (contiguous (B, S, K, H), or pools (pages, page_size,
  K, H) with ``block_table`` (B, max_pages)) in bfloat16 or float16; ``lengths`` and
  the table int32."""
  dims = plan.dims
  B, T, N, H = q.shape
  K, G, R = dims.K, dims.G, dims.rows
  # Rows (t, g) of each KV head's tile, padded to the wgmma tile with zeros: a copy of
  # the few new tokens only.
  q_rows = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, R, H)
  q_rows = pad_to(q_rows, 2, ROWS)
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  stages, bk = plan.blocks.num_stages, plan.block_k
  # In allocation order (what `_Scratch` says each holds).
  scratch = dict(
      q_smem=plgpu.SMEM((ROWS, H), q.dtype, transforms=tiled),
      k_smem=plgpu.SMEM((stages, bk, H), k.dtype, transforms=tiled),
      v_smem=plgpu.SMEM((stages, bk, H), v.dtype, transforms=tiled),
      o_smem=plgpu.SMEM((ROWS, _CHUNK), jnp.float32),
      stat_smem=plgpu.SMEM((2, ROWS), jnp.float32),
      q_loaded=plgpu.Barrier(),
      q_free=plgpu.Barrier(),
      k_loaded=plgpu.Barrier(num_arrivals=plan.copies, num_barriers=stages),
      v_loaded=plgpu.Barrier(num_arrivals=plan.copies, num_barriers=stages),
      k_free=plgpu.Barrier(num_barriers=stages),
      v_free=plgpu.Barrier(num_barriers=stages),
  )
  stat = jax.ShapeDtypeStruct((dims.splits, B, K, ROWS), jnp.float32)
  out_type = [jax.ShapeDtypeStruct((dims.splits, B, K, plan.rows_out, H), jnp.float32),
              stat, stat]
  kernel = functools.partial(
      _kernel, plan=plan, logits=Logits(scale, softcap, fused=True),
      window_left=window_left, scratch_names=tuple(scratch))
  items = _Items(dims.splits, K, plan.items, plan.ctas, plan.blocks.persistent)
  grid, grid_names = items.grid()
  args = [q_rows, k, v, lengths] + ([] if block_table is None else [block_table])
  o, m, log2_l = warp_specialized_kernel(
      kernel, out_type=out_type, consumers=1, name="decode_attention_mosaic_gpu",
      softcap=softcap, scratch_types=list(scratch.values()), grid=grid,
      grid_names=grid_names)(*args)
  return o, m, log2_l  # the merge reads the first R rows only
