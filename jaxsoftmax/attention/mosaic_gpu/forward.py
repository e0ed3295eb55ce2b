"""FlashAttention forward for Hopper GPUs (FlashAttention-3's schedule) in Pallas Mosaic GPU.

One CTA per (query tile of 2 · block_q rows, query head, batch row), three warpgroups:

- the producer (warpgroup 2) streams the K and V blocks that the CTA's masks allow
  (`masks.key_block_ranges`) by TMA into a ring of ``num_stages`` shared-memory slots;
  each slot has a "loaded" barrier that the copy completes and a "free" barrier that
  both consumers arrive on once they are done with it;
- two consumers (warpgroups 0 and 1) each own block_q query rows. Per key block:
  x = q kᵀ by wgmma into float32 registers, the online-softmax update with the scale
  folded into one FMA before ex2 (`logits.Logits`), then acc += p v by wgmma with p
  from registers. A shared "schedule" barrier alternates the two consumers, so that
  one's softmax runs while the other's matrix products occupy the tensor cores
  (FlashAttention-3, section 3.1: ping-pong scheduling).

Both consumers walk the same key blocks (those of the CTA's 2 · block_q rows), in the
three ranges of `masks.walk_block_ranges`: element masks only on the boundary blocks.
With block_kv = 2 · block_q, a causal diagonal is one key block, shared by both. Rows
past T, and keys past S, are outside the tensors: TMA reads them as zeros and never
writes them, and the key padding is masked like any other key.

The value head dim Hv may differ from the queries' H (MLA's 192 / 128): the V ring and
the accumulator take its width, and the output tiles too, which without a persistent
CTA's room for tiles of their own share the query tiles' memory (a union).

Outputs: o (B, T, N, Hv) in the input dtype through shared memory and TMA; the row
statistics m (in x's units) and log2(l) as the Triton forward writes them, (B, N, T)
float32, so that either backward can consume them; with ``float32_output`` also o in
float32 (for the backward's delta, see `triton.forward`), stored from registers.
Attention sinks join each row's (m, l) before the output is normalized
(`logits.join_sink`).

FLOPs: 2·B·N·T·S·(H + Hv), about halved by causal masking (the skipped blocks are not
loaded).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

from jaxsoftmax._core import pallas
from jaxsoftmax._core.linear_map import fold_mapped_axis, unfold_mapped_axis
from jaxsoftmax._core.mosaic_gpu import (SMEM_BYTES, claim_next, div32, pad_to, per_row, pl,
                                        plgpu, producer_loads, rem32,
                                        warp_specialized_kernel, wgmma_iota)
from jaxsoftmax.attention.call import AuxArrays
from jaxsoftmax.attention.logits import Logits, join_sink
from jaxsoftmax.attention.masks import (MaskSpec, element_mask, key_block_ranges,
                                        walk_block_ranges)

_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per query row of a consumer's tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per key of a block
_CONSUMERS = 2
# Registers per thread: the consumers take 232 and the producer 40, which fills the
# 64K registers of an SM: 2 · 128 · 232 + 128 · 40 = 64512.
_CONSUMER_REGISTERS = 232
_PRODUCER_REGISTERS = 40
_BLOCK_KV = (64, 128, 256)  # the key blocks the GPU tests run (`HopperBlockSizes`)
# The (batch row, query head) pairs from which `HopperBlockSizes.default` claims items.
_DYNAMIC_MIN_PAIRS = 64


@dataclasses.dataclass(frozen=True)
class HopperBlockSizes:
  """Tiles of the Hopper (Mosaic GPU) attention forward.

  Attributes:
    block_q: query rows of each of the two consumer warpgroups (a CTA holds 2 · block_q).
    block_kv: keys per K/V block streamed through shared memory: 64, 128 or 256.
    num_stages: K/V blocks in flight (slots of the shared-memory ring).
    persistent: one CTA per SM, each walking the (batch row, head, query tile) items
      i, i + SMs, i + 2 · SMs, ... with its K/V ring running on from one item into the
      next, instead of one CTA per item.
    one_producer_warp: the producer's loads issued by its first warp alone
      (`on_warps`), the other three skipping to the kernel's end, rather than by all
      four, each running the loads' loop and polling its barriers beside the consumers
      (FlashAttention-3's idle producer warps leave). On an H100 it ran level with the
      warpgroup's loads (647 against 647 TFLOP/s at 4x4096, 680 against 692 at head dim
      256: `benchmarks/results/tuning/tune_attention_hopper_one_producer_warp_h100.md`),
      so False. (The backward's, where it gains, is on: `HopperBackwardBlockSizes`.)
    overlap_softmax: each consumer issues block j's scores Q Kⱼᵀ and block j - 1's
      P V together, and runs block j's softmax while the P V product is still on the
      tensor cores (FlashAttention-3, section 3.2: intra-warpgroup overlapping of GEMMs
      and softmax), the two consumers still taking turns to issue (ping-pong); else each
      consumer waits for its P V before the next scores. On an H100 it ran the forward
      3-9% faster on every bfloat16 row at head dims 128 and 256 (673 against 641
      TFLOP/s at 4x4096, 745 against 685 at head dim 256:
      `benchmarks/results/tuning/tune_attention_hopper_overlap_softmax_h100.md`), so
      `default` turns it on above head dim 64 (at head dim 64 it lost up to 2%, with
      either launch: `benchmarks/results/tuning/tune_attention_hopper_h64_h100.md`).
    dynamic_schedule: with ``persistent``, each CTA takes its next item from a counter
      in global memory once it has loaded the one before, in `_Work.item_at`'s order
      (the grid's launch order), rather than a fixed share of the items: the persistent
      launch's overlap of one item's loads with the last's products, with the balance
      of the grid's own scheduling (the fixed share lost 1-7% to the grid wherever
      items differ in length). `default` takes it where it won on an H100; the
      producer's loads then come from its whole warpgroup (not ``one_producer_warp``).
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  persistent: bool = False
  one_producer_warp: bool = False
  overlap_softmax: bool = False
  dynamic_schedule: bool = False

  def __post_init__(self):
    if not (isinstance(self.block_q, int) and self.block_q > 0 and self.block_q % 64 == 0):
      raise ValueError(f"HopperBlockSizes.block_q must be a positive multiple of 64, "
                       f"got {self.block_q!r}")
    # 192-key blocks hung on an H100 under a causal mask whenever the keys were not a
    # whole number of blocks (T = 448, 1000, 2048; at head dims 64 and 128, with either
    # launch and either softmax schedule; not yet explained: docs/kernels.md), and lost
    # where they ran.
    if not (isinstance(self.block_kv, int) and self.block_kv in _BLOCK_KV):
      raise ValueError(f"HopperBlockSizes.block_kv must be one of {_BLOCK_KV}, got "
                       f"{self.block_kv!r}")
    if not (isinstance(self.num_stages, int) and self.num_stages >= 2):
      raise ValueError(f"HopperBlockSizes.num_stages must be an int >= 2, got "
                       f"{self.num_stages!r}")
    for name in ("persistent", "one_producer_warp", "overlap_softmax", "dynamic_schedule"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"HopperBlockSizes.{name} must be a bool, got "
                         f"{getattr(self, name)!r}")
    if self.dynamic_schedule and (not self.persistent or self.one_producer_warp):
      raise ValueError("HopperBlockSizes.dynamic_schedule takes persistent=True and "
                       "one_producer_warp=False")

  @classmethod
  def default(cls, head_dim: int, is_causal: bool = False,
              pairs: int | None = None, value_head_dim: int | None = None
              ) -> "HopperBlockSizes":
    """Key blocks twice the query tile (one causal diagonal block per CTA), halved
    above head dim 128 (``head_dim``: the wider of the queries' and the values') so
    that two stages of K and V fit shared memory beside Q, doubled at head dim 64
    without a causal mask (below). MLA's 192 / 128 (``value_head_dim``: the values'
    head dim, where it differs) keeps 128-key blocks: its output accumulator is no
    wider than at head dim 128, and with the outputs in the query tiles' memory (a
    union) two stages fit; not yet timed. ``pairs``: the call's (batch row, query
    head) pairs, where the caller knows them (below). From the H200
    sweeps (benchmarks/results/tuning/: tune_attention_hopper.md,
    tune_attention_hopper_persistent.md, hopper_schedule_sweep.log):
    3 stages lose 1-7% and 64-key blocks 13-19% at head dim 128. The persistent launch
    with a fixed share of the items wins only at head dim 64 without a causal mask (444
    against 404 TFLOP/s, with 3 stages): elsewhere it loses 1-7% to the hardware's own
    CTA scheduling, which balances uneven items. There 256-key blocks with 3 stages run
    9% faster than 128-key ones on an H100 (486 against 447 TFLOP/s at 8x2048, cuDNN
    473, tokamax 450, FA3 326 in the same run: tune_attention_hopper_h64_h100.md), so
    they are the default. Under a causal mask they lost 4% in two runs, and the fixed
    share lost 2-3% in two (tune_attention_hopper_h64_causal_persistent_{a,b}_h100.md).
    Above head dim 64 the softmax runs under the previous block's P V (overlap_softmax:
    3-9% on an H100); at head dim 64 it lost up to 2% (same file).

    The claimed items (`dynamic_schedule`) beat both launches on an H100 wherever a
    call has at least _DYNAMIC_MIN_PAIRS pairs at head dims up to 128, in one process
    beside the peers (attention_dynamic_h100.md, attention_schedules_{a,b}_h100.md,
    tune_attention_hopper_dynamic_h100.md): causal 4x4096x16 645 against 626 TFLOP/s,
    GQA 32/8 668 against 633 (710 against 689 without a mask), 2x8192 GQA 32/4 700
    against 683, head dim 64 causal 385-388 against 347-350 (cuDNN 384-387), head dim
    64 without a mask 493 against the fixed share's 483; 4x4096x16 without a mask, at
    head dims 128 and 96, ran level (678 against 679, 434 against 434). Those runs
    took the items heads fastest, each claimed as the item before started. In the
    launch order, claimed after the item before's last load (`_Work.item_at`, the
    claim), they ran 657 against heads fastest's 648 at 4x4096x16 causal in one run,
    level on the other rows (attention_claim_late_h100.md). With 16 pairs they run level
    with the grid at 1x16384 (708 against 707 causal, 692 against 692 without a mask;
    heads fastest had lost 3-5%) and read 0.96x it at 1x32768 causal (669 against
    696, attention_claimed_32k_h100.md, timed after the grid, where that shape's second
    row reads low: docs/kernels.md), so those keep the grid.
    Above head dim 128 they lost (MLA's 192 / 128: 599 against 606 causal, 611 against
    650 without a mask) and ptxas spills at head dim 256 (ptxas_attention_offline.md),
    so the grid stays there."""
    many_pairs = pairs is not None and pairs >= _DYNAMIC_MIN_PAIRS
    if head_dim <= 64 and not is_causal:
      return cls(block_q=64, block_kv=256, num_stages=3, persistent=True,
                 dynamic_schedule=many_pairs)
    dynamic = many_pairs and head_dim <= 128
    blocks = cls(block_q=64, block_kv=128, num_stages=2, overlap_softmax=head_dim > 64,
                 persistent=dynamic, dynamic_schedule=dynamic)
    if head_dim <= 128:
      return blocks
    # Values of head dim 128 or less under wider queries (16-bit, 2 bytes an element).
    if value_head_dim is not None and value_head_dim <= 128 and blocks.smem_bytes(
        forward_head_dim(head_dim), 2,
        value_head_dim=forward_head_dim(value_head_dim)) <= SMEM_BYTES:
      return blocks
    return dataclasses.replace(blocks, block_kv=64)

  def smem_bytes(self, head_dim: int, itemsize: int, *, output_tiles: bool = False,
                 value_head_dim: int | None = None) -> int:
    """Shared memory the forward needs at these head dims (as `forward_head_dim` pads
    them; the values' ``value_head_dim`` is ``head_dim`` unless given): the two query
    tiles, the two output tiles (with ``output_tiles``; else the outputs share the
    query tiles' memory, the wider of the two), the K and V ring, the row statistics,
    and 1 KiB for the barriers and alignment."""
    hv = head_dim if value_head_dim is None else value_head_dim
    rows = _CONSUMERS * self.block_q
    io = rows * (head_dim + hv) if output_tiles else rows * max(head_dim, hv)
    tiles = io + self.num_stages * self.block_kv * (head_dim + hv)
    return tiles * itemsize + 2 * rows * 4 + 1024


def wgmma_head_dim(head_dim: int) -> int:
  """The backward's head dim, padded to a multiple of 64: its tiles are rows of 64
  elements under the 128-byte swizzle, and its dQ goes out in 64-column chunks. The
  forward pads less (`forward_head_dim`)."""
  return -(-head_dim // 64) * 64


def forward_head_dim(head_dim: int) -> int:
  """The forward's head dim, padded to a multiple of 32: its tiles are rows of 64
  elements under the 128-byte swizzle where that divides them, else rows of 32 under the
  64-byte one (`smem_transforms`). Padded to 128, as the backward pads it, head dim 96
  cost the forward a third more products: 434 TFLOP/s against tokamax's 586 on an H100
  (benchmarks/results/tuning/attention_schedules_b_h100.md)."""
  return -(-head_dim // 32) * 32


def smem_transforms(width: int) -> tuple:
  """The shared-memory layout of 16-bit tiles ``width`` (`forward_head_dim`) elements
  wide: (8, 64) tiles under the 128-byte swizzle where 64 divides the width, else (8,
  32) tiles under the 64-byte one; wgmma and TMA take either."""
  columns = 64 if width % 64 == 0 else 32
  return plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(2 * columns)


@dataclasses.dataclass(frozen=True)
class _Work:
  """The CTAs' work items, one per (batch row, query head, query tile), and the order in
  which the CTAs take them."""

  batch: int
  heads: int
  q_tiles: int
  causal: bool
  # One CTA per SM walking items i, i + sm_count, ... (persistent), else one per item.
  sm_count: int | None
  # Persistent CTAs claiming their items after the first from a counter
  # (`HopperBlockSizes.dynamic_schedule`), in the order of `item_at`.
  dynamic: bool = False

  @property
  def count(self) -> int:
    return self.batch * self.heads * self.q_tiles

  @property
  def ctas(self) -> int:
    return self.count if self.sm_count is None else min(self.sm_count, self.count)

  def grid(self):
    if self.sm_count is None:
      return (self.heads, self.q_tiles, self.batch), ("heads", "q_tiles", "batch")
    return (self.ctas,), ("sm",)

  def for_each(self, body, carry, claimed=None):
    """carry = body(i, (b, n, tile), carry) over the CTA's items, i counting them;
    ``dynamic``: item 0 is the CTA's own index, and ``claimed(i)`` the index of item i
    (`item_at`; ``count`` or more once there are no more)."""
    if self.sm_count is None:
      tile = lax.axis_index("q_tiles")
      if self.causal:  # later tiles walk more key blocks: start them first
        tile = self.q_tiles - 1 - tile
      return body(0, (lax.axis_index("batch"), lax.axis_index("heads"), tile), carry)
    cta = lax.axis_index("sm")
    if not self.dynamic:
      return lax.fori_loop(0, self.item_count(cta),
                           lambda i, c: body(i, self.item(cta, i), c), carry)

    def step(state):
      i, w, c = state
      c = body(i, self.item_at(w), c)
      return i + 1, claimed(i + 1), c

    return lax.while_loop(lambda state: state[1] < self.count, step,
                          (jnp.int32(0), cta.astype(jnp.int32), carry))[2]

  def _position(self, cta, i):
    """The persistent CTA's position within round i of the item order."""
    if not self.causal:
      return cta
    # Items come heaviest first; alternating the direction of the rounds (a snake)
    # pairs each CTA's heavier items with lighter ones.
    return jnp.where(rem32(i, 2) == 0, cta, self.ctas - 1 - cta)

  def item_count(self, cta):
    """How many items the persistent CTA ``cta`` walks."""
    rounds, last = divmod(self.count, self.ctas)  # full rounds, items of the last one
    return rounds + (self._position(cta, rounds) < last).astype(jnp.int32)

  def item(self, cta, i):
    """(b, n, tile) of the persistent CTA's item i of its fixed share."""
    w = i * self.ctas + self._position(cta, i)
    if self.causal:  # the tiles that walk the most key blocks first, over every row and head
      rank, rest = div32(w, self.heads * self.batch), rem32(w, self.heads * self.batch)
      return div32(rest, self.heads), rem32(rest, self.heads), self.q_tiles - 1 - rank
    return self.item_at(w)

  def item_at(self, w):
    """(b, n, tile) of item w in the grid's launch order: batch rows fastest, then query
    tiles (under a causal mask the longest first), heads slowest. Pallas' Mosaic GPU
    lowering puts the grid's last axis on CUDA's x, launched fastest: Nsight Compute
    reads the grid as (batch, tiles, heads) in
    benchmarks/results/tuning/ncu_attention_forward_16k_causal_grid_h100.log. So the
    CTAs at work together walk the tiles of one or a few heads, whose K and V L2 holds,
    and each head's shortest tiles come last. Heads fastest, as until 2026-12-07,
    walked all 16 heads of 1x16384 at once (128 MiB of K and V): L2 hits 77% against
    the grid's 94%, and 3-5% slower than it (docs/kernels.md, claimed items)."""
    b, rest = rem32(w, self.batch), div32(w, self.batch)
    tile, n = rem32(rest, self.q_tiles), div32(rest, self.q_tiles)
    if self.causal:
      tile = self.q_tiles - 1 - tile
    return b, n, tile


class _Scratch(NamedTuple):
  """The forward's shared memory and barriers, by name (`_forward` allocates those a
  call needs, in its own order; the others are None)."""

  k_smem: Any  # the K ring
  v_smem: Any  # the V ring
  stat_smem: Any  # m and log2(l) on their way out
  q_loaded: Any  # query tile loaded
  q_free: Any  # query tile free
  k_loaded: Any  # K slot loaded
  v_loaded: Any  # V slot loaded
  k_free: Any  # K slot free
  v_free: Any  # V slot free
  # The consumers' turns on the tensor cores: one barrier both arrive on twice a block
  # (schedule), or with overlap_softmax one a consumer (turns), which the other
  # completes once a block when it has issued its products.
  schedule: Any = None
  turns: Any = None
  # The consumers' query tiles (q_smem), through which their outputs go out unless they
  # have output tiles of their own (o_smem: where a persistent CTA has room); or, where
  # the value head dim differs and they have none, query and output tiles of one
  # memory (qo_smem, a `plgpu.RefUnion`).
  q_smem: Any = None
  o_smem: Any = None
  qo_smem: Any = None
  # With `HopperBlockSizes.dynamic_schedule`: the claimed indices of the CTA's next
  # items, (2, 1) int32 taken in turn, and a barrier a slot that the producer arrives on
  # once the claim is in.
  item_slots: Any = None
  item_ready: Any = None


def _kernel(q_ref, k_ref, v_ref, *refs, aux_present, spec: MaskSpec, blocks, logits: Logits,
            group: int, work: _Work, scratch_names: tuple[str, ...], float32_output: bool,
            with_sinks: bool):
  aux_refs, refs = AuxArrays.split_refs(refs, aux_present)
  q_len_ref, kv_len_ref, q_seg_ref, kv_seg_ref = aux_refs.lengths_and_segments
  sink_ref, refs = (refs[0], refs[1:]) if with_sinks else (None, refs)
  o_ref, m_ref, log2_l_ref, *refs = refs
  o32_ref = refs.pop(0) if float32_output else None
  scratch = _Scratch(**dict(zip(scratch_names, refs, strict=True)))
  k_smem, v_smem, stat_smem = scratch.k_smem, scratch.v_smem, scratch.stat_smem
  if scratch.qo_smem is None:
    q_smem = out_smem = scratch.q_smem
  else:
    q_smem, out_smem = scratch.qo_smem
  q_loaded, q_free, k_loaded, v_loaded = (scratch.q_loaded, scratch.q_free,
                                          scratch.k_loaded, scratch.v_loaded)
  k_free, v_free, schedule, turns, o_smem = (scratch.k_free, scratch.v_free,
                                             scratch.schedule, scratch.turns, scratch.o_smem)

  bq, bkv, stages = blocks.block_q, blocks.block_kv, blocks.num_stages
  wg = lax.axis_index("wg")
  # The count of items claimed (`dynamic_schedule`): shared by every CTA, so from
  # pl.get_global, which Pallas zeroes at each call (a scratch semaphore is the CTA's own).
  counter = pl.get_global(plgpu.SemaphoreType.REGULAR((1,))) if work.dynamic else None

  def claim(i):
    """The producer claims the CTA's item i + 1 into slot (i + 1) % 2. Called in item
    i after its loads, which waited for both consumers to free their query tiles, so
    they are past the start of item i - 1, where they read that slot last (in item 0
    the slot is still unused)."""
    s = rem32(i + 1, 2)
    for slot in range(2):
      pl.when(s == slot)(lambda slot=slot: claim_next(counter, scratch.item_slots.at[slot]))
    plgpu.barrier_arrive(scratch.item_ready.at[s])

  def claimed(i):
    """The index of the CTA's item i (i >= 1), once the producer has claimed it."""
    s = rem32(i, 2)
    plgpu.barrier_wait(scratch.item_ready.at[s])
    return work.ctas + scratch.item_slots[s, 0]

  def item_ranges(item):
    """Producer and consumers agree on the key blocks of an item's query rows."""
    b, _, tile = item
    q0 = tile * (_CONSUMERS * bq)
    q_length = None if q_len_ref is None else q_len_ref[b]
    kv_length = None if kv_len_ref is None else kv_len_ref[b]
    ranges = key_block_ranges(spec, q0, _CONSUMERS * bq, bkv, kv_length, q_length)
    return q0, q_length, kv_length, ranges

  def schedule_turn():
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(schedule)

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
    q_tile = q_smem.at[wg]
    out_tile = (out_smem if o_smem is None else o_smem).at[wg]
    m_smem, log2_l_smem = stat_smem.at[0, wg], stat_smem.at[1, wg]

    def item_body(_, item, consumed):
      b, n, _ = item
      q0, q_length, kv_length, (lo, full_lo, full_hi, hi) = item_ranges(item)
      row0 = q0 + wg * bq

      def slot(j):  # the ring runs on across the CTA's items
        return rem32(consumed + j - lo, stages)

      q_seg = None
      if q_seg_ref is not None:
        q_seg = plgpu.load(q_seg_ref.at[b, pl.ds(row0, bq)], layout=_ROW, optimized=False)
      plgpu.barrier_wait(q_loaded.at[wg])

      value_dim = v_smem.shape[-1]
      shape = (bq, bkv)
      def masked_logits(x, j, masked: bool):
        x, _ = logits.cap(x)
        if not masked:
          return x
        k_seg = None
        if kv_seg_ref is not None:
          k_seg = plgpu.load(kv_seg_ref.at[b, pl.ds(j * bkv, bkv)], layout=_COL,
                             optimized=False)
          k_seg = lax.broadcast_in_dim(k_seg, shape, [1])
        allowed = element_mask(spec, row0 + wgmma_iota(shape, 0), j * bkv + wgmma_iota(shape, 1),
                               kv_length, None if q_seg is None else per_row(q_seg, shape),
                               k_seg)
        return jnp.where(allowed, x, -jnp.inf)

      def softmax(x, m, l, masked: bool, p_dtype=v_smem.dtype):
        """The online-softmax update by the block's logits x: (m', l', p, alpha), p in
        ``p_dtype``."""
        m_new = jnp.maximum(m, x.max(axis=1))
        # A row with no allowed key so far keeps m = -inf; shifting it by 0 keeps its p
        # and alpha at exp2(-inf) = 0 instead of NaN. Unmasked blocks always hold one.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(logits.exponent(m, shift))
        p = jnp.exp2(logits.exponent(x, shift, functools.partial(per_row, shape=x.shape)))
        return m_new, l * alpha + p.sum(axis=1), p.astype(p_dtype), alpha

      m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), _ROW)
      l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), _ROW)
      acc = plgpu.layout_cast(jnp.zeros((bq, value_dim), jnp.float32), plgpu.Layout.WGMMA)

      def step(j, carry, *, masked: bool):
        acc, m, l = carry
        s = slot(j)

        def scores(acc_ref):
          plgpu.wgmma(acc_ref, q_tile, k_smem.at[s].T)
          schedule_turn()  # let the other consumer's P V run while this product finishes
          return acc_ref[...]

        x = pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))
        plgpu.barrier_arrive(k_free.at[s])
        if o_smem is not None:  # the last product of the query tile is done: refill it
          pl.when(j + 1 == hi)(lambda: plgpu.barrier_arrive(q_free.at[wg]))
        x = masked_logits(x, j, masked)
        m_new, l, p16, alpha = softmax(x, m, l, masked)
        acc = acc * per_row(alpha, acc.shape)
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(v_loaded.at[s])
        plgpu.barrier_wait(schedule)
        # Computed outside run_state, which would turn closed-over constants into refs.
        more, next_slot = j + 1 < hi, slot(j + 1)

        def values(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_smem.at[s])

          @pl.when(more)
          def _():
            plgpu.barrier_wait(k_loaded.at[next_slot])

        acc = pl.run_state(values)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[s])
        return acc, m_new, l

      def my_turn():  # wait until the other consumer has issued its products
        plgpu.barrier_wait(turns.at[wg])

      def pass_turn():
        plgpu.barrier_arrive(turns.at[1 - wg])

      def first_scores(carry):
        """Block lo's scores and softmax, with no P V yet to overlap."""
        acc, m, l = carry
        s = slot(lo)
        my_turn()
        plgpu.barrier_wait(k_loaded.at[s])

        def scores(x_ref):
          plgpu.wgmma(x_ref, q_tile, k_smem.at[s].T)
          pass_turn()
          return x_ref[...]

        x = pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))
        plgpu.barrier_arrive(k_free.at[s])
        # Masked whether or not lo needs it: one block's element mask, kept out of a
        # second copy of this code.
        m, l, p16, _ = softmax(masked_logits(x, lo, True), m, l, True)
        return acc, m, l, p16

      def overlapped_step(j, carry, *, masked: bool):
        """Block j's scores and block j - 1's P V issued in one turn; block j's softmax
        while P V runs. acc holds blocks < j - 1, scaled to m of block j - 1."""
        acc, m, l, p16 = carry
        s, s_prev = slot(j), slot(j - 1)
        my_turn()
        plgpu.barrier_wait(k_loaded.at[s])
        plgpu.barrier_wait(v_loaded.at[s_prev])

        def products(x_ref, o_ref):
          o_ref[...] = acc
          plgpu.wgmma(x_ref, q_tile, k_smem.at[s].T)
          plgpu.wgmma(o_ref, p16, v_smem.at[s_prev])
          pass_turn()
          x = plgpu.wgmma_accumulator_load(x_ref, wait_n=1)  # the scores; P V in flight
          plgpu.barrier_arrive(k_free.at[s])
          # p stays float32 until P V is done: ptxas serializes every wgmma of the
          # kernel if registers that one reads (the next P) are written while another
          # is in flight (its warning C7513), as FlashAttention-3 converts P after the
          # wait too. The softmax is done before that wait, not sunk past it.
          out = lax.optimization_barrier(
              softmax(masked_logits(x, j, masked), m, l, masked, jnp.float32))
          return o_ref[...], *out

        acc, m, l, p, alpha = pl.run_scoped(products, plgpu.ACC(shape, jnp.float32),
                                            plgpu.ACC(acc.shape, jnp.float32))
        plgpu.barrier_arrive(v_free.at[s_prev])
        return acc * per_row(alpha, acc.shape), m, l, p.astype(v_smem.dtype)

      def last_values(carry):
        """Block hi - 1's P V, in a turn of its own."""
        acc, m, l, p16 = carry
        s = slot(hi - 1)
        my_turn()
        plgpu.barrier_wait(v_loaded.at[s])

        def values(o_ref):
          plgpu.wgmma(o_ref, p16, v_smem.at[s])
          pass_turn()

        acc = pl.run_state(values)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[s])
        return acc, m, l

      def overlapped_walk(carry):
        carry = first_scores(carry)
        after = lambda x: jnp.maximum(x, lo + 1)  # the blocks after lo
        carry = walk_block_ranges((lo + 1, after(full_lo), after(full_hi), hi),
                                  overlapped_step, carry)
        return last_values(carry)

      if blocks.overlap_softmax:
        acc, m, l = lax.cond(hi > lo, overlapped_walk, lambda c: c, (acc, m, l))
      else:
        pl.when(hi > lo)(lambda: plgpu.barrier_wait(k_loaded.at[slot(lo)]))
        # Consumer 0 takes the tensor cores first; consumer 1 waits for its first turn.
        pl.when(wg == 1)(schedule_turn)
        acc, m, l = walk_block_ranges((lo, full_lo, full_hi, hi), step, (acc, m, l))
        pl.when(wg == 0)(schedule_turn)  # consumer 1's last turn
      if o_smem is not None:
        if blocks.overlap_softmax:  # the last scores are done (or there were none)
          plgpu.barrier_arrive(q_free.at[wg])
        else:  # no product read the query tile
          pl.when(hi <= lo)(lambda: plgpu.barrier_arrive(q_free.at[wg]))

      # Rows with no allowed key (l = 0), and rows past the query length, give 0; a NaN
      # input's NaN l stays NaN (NaN != 0).
      some = l != 0
      if q_length is not None:
        some = some & (row0 + plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=_ROW)
                       < q_length)
      has_l, alpha = some, 1.0
      if sink_ref is not None:  # every row joins its sink, from an empty state if not `some`
        m, l, alpha = join_sink(logits, jnp.where(some, m, -jnp.inf),
                                jnp.where(some, l, 0.0), sink_ref[b * work.heads + n],
                                jnp.exp2)
        has_l = l != 0
      inv_l = jnp.where(some, alpha / jnp.where(has_l, l, 1.0), 0.0)
      o = acc * per_row(inv_l, acc.shape)
      if o_smem is not None:  # the previous item's output has left shared memory
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      # With no output tiles, the query tile takes the output: all products are done.
      out_tile[...] = o.astype(out_tile.dtype)
      # A NaN l makes m NaN too: the GPU's max skips NaN, and lse and the backward's P
      # must carry it (docs/numerics.md).
      m_smem[...] = jnp.where(has_l, jnp.where(l == l, m, jnp.nan), -jnp.inf)
      log2_l_smem[...] = jnp.log2(jnp.where(has_l, l, 1.0))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_tile, o_ref.at[b, pl.ds(row0, bq), n])
      plgpu.copy_smem_to_gmem(m_smem, m_ref.at[b, n, pl.ds(row0, bq)])
      plgpu.copy_smem_to_gmem(log2_l_smem, log2_l_ref.at[b, n, pl.ds(row0, bq)])
      if o32_ref is not None:  # rows padded to whole tiles: a direct store stays inside
        o32_ref.at[b, pl.ds(row0, bq), n][...] = o
      if o_smem is None:  # the output has left the query tile and the statistics
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.barrier_arrive(q_free.at[wg])
      return consumed + (hi - lo)

    if blocks.overlap_softmax:  # consumer 0 takes the tensor cores first
      pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turns.at[0]))
    work.for_each(item_body, jnp.int32(0), claimed)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _CONSUMERS)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

    def item_body(i, item, issued):
      b, n, _ = item
      q0, _, _, (lo, _, _, hi) = item_ranges(item)
      kv_head = div32(n, group)

      def load_kv(j):
        g = issued + j - lo  # the ring starts empty: its first loads wait for no slot
        s = rem32(g, stages)
        rows = (b, pl.ds(j * bkv, bkv), kv_head)
        pl.when(g >= stages)(lambda: plgpu.barrier_wait(k_free.at[s]))
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[s], k_loaded.at[s])
        pl.when(g >= stages)(lambda: plgpu.barrier_wait(v_free.at[s]))
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[s], v_loaded.at[s])

      # The item's first K/V block may go as soon as a slot is free; its query tiles wait
      # until the previous item's consumers are done with theirs.
      pl.when(lo < hi)(functools.partial(load_kv, lo))
      for c in range(_CONSUMERS):
        pl.when(i > 0)(functools.partial(plgpu.barrier_wait, q_free.at[c]))
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0 + c * bq, bq), n], q_smem.at[c],
                                q_loaded.at[c])
      pl.loop(lo + 1, hi)(load_kv)
      # The claim comes after the item's last load, a ring's worth of key blocks before
      # its consumers finish, so that the next item goes to a CTA about to be free. Made
      # among the item's first loads, as until 2026-12-07, it tied each CTA's next item
      # to the start of the one before: with the longest tiles of a head claimed
      # together, one CTA took two of them, and the kernel ran 9-10% past the SMs'
      # average active cycles (docs/kernels.md, claimed items).
      if work.dynamic:
        claim(i)
      return issued + (hi - lo)

    def loads():  # returns nothing, as a warp's branch must
      work.for_each(item_body, jnp.int32(0), claimed)

    producer_loads(loads, blocks.one_producer_warp)


def forward(q, k, v, aux_arrays, *, spec: MaskSpec, blocks: HopperBlockSizes, scale: float,
            softcap: float | None, float32_output: bool = False, sinks=None):
  """(o (B, T, N, Hv), m (B, N, T), log2_l (B, N, T)[, o in float32]) for q (B, T, N, H),
  k (B, S, K, H) and v (B, S, K, Hv) in bfloat16 or float16; ``aux_arrays`` are (query lengths,
  key lengths, query segment ids, key segment ids), each None or an int32 array;
  ``sinks`` None or (B, N) float32 logits joined in the epilogue (`logits.join_sink`).

  Under ``jax.vmap`` the mapped axes fold into the batch, so that one launch serves every
  batch element. Pallas' own batching would add a grid axis instead, whose CTAs would all
  claim items from the one counter of `dynamic_schedule` (a launch's ``pl.get_global``)
  and so skip items of their own element; and a persistent launch per element is no
  longer one CTA an SM."""
  aux = aux_arrays.lengths_and_segments  # all the kernel reads, each with B leading
  present = tuple(a is not None for a in aux)
  run = custom_vmap(functools.partial(
      _forward_arrays, present=present, with_sinks=sinks is not None, spec=spec,
      blocks=blocks, scale=scale, softcap=softcap, float32_output=float32_output))

  @run.def_vmap
  def _fold_into_batch(axis_size, in_batched, *arrays):
    # Every array's leading axis is B; custom_vmap puts a mapped axis first.
    outs = run(*(fold_mapped_axis(a, axis_size, 0 if batched else None)
                 for a, batched in zip(arrays, in_batched)))
    return tuple(unfold_mapped_axis(x, axis_size) for x in outs), (True,) * len(outs)

  arrays = (q, k, v, *(a for a in aux if a is not None), *(() if sinks is None else (sinks,)))
  return run(*arrays)


def _forward_arrays(q, k, v, *arrays, present, with_sinks, **params):
  """`forward` of its arrays in order: the lengths and segment ids that are ``present``,
  then the sinks ``with_sinks``."""
  arrays = iter(arrays)
  aux = AuxArrays(*(next(arrays) if p else None for p in present))
  return tuple(_forward(q, k, v, aux, sinks=next(arrays) if with_sinks else None, **params))


def _forward(q, k, v, aux_arrays, *, spec: MaskSpec, blocks: HopperBlockSizes, scale: float,
             softcap: float | None, float32_output: bool, sinks):
  """`forward` on arrays that no vmap maps."""
  B, T, N, H = q.shape
  S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
  H_pad, Hv_pad = forward_head_dim(H), forward_head_dim(Hv)
  # TMA moves the (8, 64) or (8, 32) tiles of the shared-memory layout: sequences are
  # padded to a multiple of 8 rows (a copy only for such lengths), the head dims to one
  # of 32; the zeros change no product, and the padding keys are masked.
  T8, S8 = -(-T // 8) * 8, -(-S // 8) * 8
  q = pad_to(pad_to(q, 1, T8), 3, H_pad)
  k, v = pad_to(pad_to(k, 1, S8), 3, H_pad), pad_to(pad_to(v, 1, S8), 3, Hv_pad)
  bq, bkv = blocks.block_q, blocks.block_kv
  n_q_tiles = pl.cdiv(T, _CONSUMERS * bq)
  T_pad = n_q_tiles * _CONSUMERS * bq
  q_len, kv_len, q_seg, kv_seg = aux_arrays.lengths_and_segments
  # Vector loads from global memory have no bounds: segment ids are padded to whole
  # tiles (the padding keys are masked by position anyway).
  if q_seg is not None:
    q_seg = pad_to(q_seg, 1, T_pad, -1)
    kv_seg = pad_to(kv_seg, 1, pl.cdiv(S, bkv) * bkv, -2)
  aux = AuxArrays(q_len, kv_len, q_seg, kv_seg)

  stages = blocks.num_stages
  work = _Work(B, N, n_q_tiles, spec.is_causal,
               pallas.num_cores() if blocks.persistent else None, blocks.dynamic_schedule)
  # A persistent CTA refills its query tiles while the previous item finishes, so its
  # outputs need tiles of their own, where shared memory has room for them. Elsewhere
  # the outputs take the query tiles' memory once their products are done, through a
  # union where the value head dim differs (MLA's 192 / 128: that leaves room for
  # 128-key blocks, `HopperBlockSizes.default`).
  output_tiles = blocks.persistent and blocks.smem_bytes(
      H_pad, q.dtype.itemsize, output_tiles=True, value_head_dim=Hv_pad) <= SMEM_BYTES
  tile = lambda width: plgpu.SMEM((_CONSUMERS, bq, width), q.dtype,
                                  transforms=smem_transforms(width))
  shared_tiles = not output_tiles and Hv_pad != H_pad
  # In allocation order (what `_Scratch` says each holds).
  scratch = dict(
      **(dict(qo_smem=plgpu.RefUnion(tile(H_pad), tile(Hv_pad))) if shared_tiles
         else dict(q_smem=tile(H_pad))),
      **(dict(o_smem=tile(Hv_pad)) if output_tiles else {}),
      k_smem=plgpu.SMEM((stages, bkv, H_pad), k.dtype, transforms=smem_transforms(H_pad)),
      v_smem=plgpu.SMEM((stages, bkv, Hv_pad), v.dtype, transforms=smem_transforms(Hv_pad)),
      stat_smem=plgpu.SMEM((2, _CONSUMERS, bq), jnp.float32),
      q_loaded=plgpu.Barrier(num_barriers=_CONSUMERS),
      q_free=plgpu.Barrier(num_barriers=_CONSUMERS),
      k_loaded=plgpu.Barrier(num_barriers=stages),
      v_loaded=plgpu.Barrier(num_barriers=stages),
      k_free=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
      v_free=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
      **(dict(turns=plgpu.Barrier(num_barriers=_CONSUMERS)) if blocks.overlap_softmax
         else dict(schedule=plgpu.Barrier(num_arrivals=_CONSUMERS))),
      **(dict(item_slots=plgpu.SMEM((2, 1), jnp.int32), item_ready=plgpu.Barrier(num_barriers=2))
         if blocks.dynamic_schedule else {}),
  )
  stat = jax.ShapeDtypeStruct((B, N, T_pad), jnp.float32)
  out_type = [jax.ShapeDtypeStruct((B, T8, N, Hv_pad), q.dtype), stat, stat]
  if float32_output:
    out_type.append(jax.ShapeDtypeStruct((B, T_pad, N, Hv_pad), jnp.float32))
  kernel = functools.partial(
      _kernel, aux_present=AuxArrays(*aux).present, spec=spec, blocks=blocks,
      logits=Logits(scale, softcap, fused=softcap is None), group=N // K, work=work,
      scratch_names=tuple(scratch), float32_output=float32_output,
      with_sinks=sinks is not None)
  # Each consumer reads its head's sink as a scalar from global memory.
  sink_inputs = [] if sinks is None else [sinks.astype(jnp.float32).reshape(B * N)]
  grid, grid_names = work.grid()
  # The query tile is written only once the products that read it are done.
  outputs = warp_specialized_kernel(
      kernel, out_type=out_type, consumers=_CONSUMERS, name="attention_forward_mosaic_gpu",
      softcap=softcap, scratch_types=list(scratch.values()), grid=grid, grid_names=grid_names,
  )(q, k, v, *(a for a in aux if a is not None), *sink_inputs)
  o, m, log2_l, *o32 = outputs
  o, m, log2_l = o[:, :T, :, :Hv], m[..., :T], log2_l[..., :T]
  return (o, m, log2_l, *(x[:, :T, :, :Hv] for x in o32))
