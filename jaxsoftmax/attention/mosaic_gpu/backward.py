"""FlashAttention backward for Hopper GPUs (FlashAttention-3's schedule) in Pallas Mosaic GPU.

The math is the Triton backward's (`triton.backward`), with the row statistics folded
into one per query, lse₂ = m · c + log2(l) (+inf for a row with no allowed key, so that
its probabilities are exactly 0):

    Pᵀ = 2^(Sᵀ · c - lse₂);  dV += Pᵀ dO;  dPᵀ = V dOᵀ;  dSᵀ = Pᵀ ∘ (dPᵀ - delta)
    dK += dSᵀ Q;  dQ += dS K;  (dK and dQ times the logits' scale at the end)

Up to head dim 128, one CTA per (key tile of 2 · block_kv keys, K/V head, batch row),
three warpgroups:

- the producer (warpgroup 2) loads the CTA's K and V once, then streams, for every query
  head of the K/V head's group and every query block that may see the CTA's keys
  (`masks.query_block_ranges`), Q with lse₂ and dO with delta by TMA into a ring of
  ``num_stages`` slots; a slot is free again once both consumers are done with it;
- two consumers each own block_kv of the keys and hold their dK and dV in float32
  registers. Per query block each computes Sᵀ = K Qᵀ, Pᵀ, dV, dPᵀ, dSᵀ and dK (Pᵀ and
  dSᵀ are the register operands of the dV and dK products), and writes dSᵀ to shared
  memory. Once both halves are there, dQ = dS K over the CTA's 2 · block_kv keys is split
  into 64-column chunks of the head dim, taken by the two consumers in turn; each chunk
  leaves through shared memory by a TMA copy with an add reduction into a float32 dQ in
  global memory (FlashAttention-3, section 3.3: dQ accumulated by atomic adds, so each
  block pair costs 5 tile products instead of the 7 of separate dK/dV and dQ kernels).

Above head dim 128 (`SPLIT_KEYS_HEAD_DIM`; for a value head dim Hv of its own, where
H + Hv exceeds twice that, save MLA's 192 + 128 in bfloat16:
`HopperBackwardBlockSizes.wide`) a consumer cannot hold both dK and dV of its keys (256
float32 registers a thread at 256), so the wide design gives each CTA one block of
block_kv keys and splits the gradients instead: both consumers compute Pᵀ; consumer 0
accumulates dV += Pᵀ dO and takes every chunk of dQ, consumer 1 computes dPᵀ and dSᵀ,
hands dSᵀ to consumer 0 through shared memory and accumulates dK += dSᵀ Q. Sᵀ is
computed twice, so a block pair costs 6 tile products, three a consumer. On the H200 at
2x8192x16x256 it measured 362 TFLOP/s against cuDNN's 352, backward alone
(`benchmarks/results/attention_backward.md`).

The order of the adds into dQ varies from run to run: results agree to float32 rounding,
not bit for bit. ``deterministic=True`` at head dims up to 128 runs the same kernel
without dQ and then a dQ kernel of its own (one CTA per query tile, laid out as the
forward, recomputing S and dP: 7 tile products per block pair). On the H200 it
measured 0.80x-0.88x the atomic design's speed on the causal and GQA shapes
(`benchmarks/results/tuning/attention_backward_schedules.md`), so the atomic design is
the default and this one serves deterministic calls. Above head dim 128 deterministic
calls keep the atomic kernel and order each query block's adds
(`HopperBackwardBlockSizes.ordered_dq_adds`, docs/kernels.md).

Masks as in the forward: element masks only on the boundary query blocks, and on every
block of a key tile that holds keys past the key length or past S (their probabilities
must be 0 for dQ, which sums over keys). In float16, dS goes into its products as two
float16 terms (`logits.score_grad_terms`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax._core.mosaic_gpu import (SMEM_BYTES, div32, on_warps, pad_to, per_row, pl,
                                        plgpu, producer_loads, rem32,
                                        warp_specialized_kernel, wgmma_iota)
from jaxsoftmax._core.pallas import num_cores
from jaxsoftmax.attention.call import AuxArrays
from jaxsoftmax.attention.logits import (LOG2E, Logits, score_grad,
                                         score_grad_term_count, score_grad_terms)
from jaxsoftmax.attention.masks import (MaskSpec, element_mask, key_block_ranges,
                                        query_block_ranges, walk_block_ranges)
from jaxsoftmax.attention.mosaic_gpu.forward import wgmma_head_dim
from jaxsoftmax.attention.triton.delta import row_delta

# One value per row, and per column, of a wgmma tile: the dK/dV kernel works on
# Sᵀ = K Qᵀ (a row per key, a column per query), the dQ kernel on S = Q Kᵀ.
_ROW = plgpu.Layout.WGMMA.reduce(1)
_COL = plgpu.Layout.WGMMA.reduce(0)
_CONSUMERS = 2
# Registers per thread: 2 · 128 · 240 + 128 · 24 = 64512 of an SM's 64K. A consumer
# holds dK and dV (2 · 64 at head dim 128) beside Sᵀ, dPᵀ and a dQ chunk (32 each).
_CONSUMER_REGISTERS = 240
_PRODUCER_REGISTERS = 24
# dQ leaves in chunks of this many head-dim columns (one 128-byte swizzle of 16-bit K).
_CHUNK = 64
# With `l2_sections`, a launch section holds at least this share of a wave of CTAs (one
# an SM): fewer, and the sections after it start their longest causal key tiles late
# (`l2_section`).
L2_SECTION_WAVE = 0.9
# Up to this head dim each consumer holds dK and dV of its own keys; above it the wide
# design splits them: one consumer holds dV (and takes dQ), the other dK.
SPLIT_KEYS_HEAD_DIM = 128
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class HopperBackwardBlockSizes:
  """Tiles and schedule of the Hopper backward. The defaults are the schedule that won
  the sweep on the H200 (`benchmarks/results/tuning/attention_backward_schedules.md`).

  Attributes:
    block_q: query rows per streamed block.
    block_kv: keys per consumer (a CTA holds 2 · block_kv, or block_kv in the wide
      design).
    num_stages: slots of the Q/dO ring. Three measured no faster than two at head dim
      128; in the wide design three gave a wrong dQ on the H200 (head dim 256, causal
      GQA: 2.6e-2 against the 2x rule's 2.4e-2), not traced, so it takes two only.
    fresh_tile_addresses: in the split-keys design, the consumers address their K and V
      tiles afresh in every step, through a key-block index LLVM cannot see is constant
      (`lax.optimization_barrier`). Otherwise LLVM hoists the wgmma descriptors of the
      K, V and dQ-chunk tiles out of the loop, two registers each, and ptxas spills them
      and reloads them in every step (docs/kernels.md, on what the backward spills): on
      the H200 this took the causal and GQA backwards from 384-531 to 524-618 TFLOP/s.
      The wide design addresses its tiles as they are: at MLA's head dims, where it
      spills nothing either way, fresh addresses measured 4% slower causal; at head dim
      256 they remove every spill offline (168 / 200 bytes causal) and timed level on an
      H100 (362 against 364 TFLOP/s causal, 314 against 311 on GQA 32/8:
      benchmarks/results/tuning/attention_backward_wide_fresh_h256_h100.md).
    fresh_mask_offsets: in the split-keys design, a masked step's element mask takes the
      consumer's first key through an optimization barrier too, so that the keys'
      offsets are computed in the step. Otherwise, on GQA, LLVM hoists them out of the
      walk over the group's heads and ptxas spills them: the SASS of the causal
      backward on GQA 32/8 stores 15 values before the walk and reloads them in the
      steps, most of them these (docs/kernels.md, on what the GQA backward spills).
      Offline, bytes of spill stores / loads, off against on: 68 / 96 against 32 / 60
      at 4x4096 32/8 causal, 68 / 120 against 32 / 80 at 2x8192 32/4, 76 / 84 against
      32 / 40 at 2x1000 32/8 (64 / 64 against 12 / 12 with lengths, 180 / 244 against
      132 / 192 in float16; the deterministic dK/dV kernel 16 / 28 against none at
      4x4096 32/8); MHA, head dim 64 and calls without a mask unchanged. None (the
      default): where a CTA walks more than one query head (`takes_fresh_mask_offsets`).
      On an H100, causal, two runs each
      (benchmarks/results/tuning/attention_backward_fmask_h100.md and its _repeat):
      1-5% faster at 2x8192 32/4 (walks of 4 heads), level at 4x4096 32/8 and with
      MHA's dQ by atomic adds, but 3-4% slower in MHA's deterministic dK/dV kernel,
      where there is no walk to hoist out of.
    fa3_step_order: FlashAttention-3's order of a step's products in the split-keys
      design: Sᵀ and dPᵀ issued together, Pᵀ computed while dPᵀ runs, then dV, dK and dQ
      issued from Pᵀ and dSᵀ in 16 bits, so that no float32 tile is live beside dK and
      dV while they run. Otherwise dPᵀ is issued after Pᵀ, with dV, and dSᵀ formed while
      dV runs. None (the default): where H + Hv exceeds 2 · `SPLIT_KEYS_HEAD_DIM`
      (MLA's 192 + 128), whose spills it cuts from 464 to 144 bytes; at 128 + 128 it
      measured 1-2% slower (`fa3_order`).
    split_keys_width: the largest sum of the padded head dims H + Hv at which each
      consumer holds dK and dV of its own block of keys (above 2 · `SPLIT_KEYS_HEAD_DIM`
      only where its shared memory fits); above it, the wide design. At MLA's
      192 + 128 = 320 the split-keys design fits bfloat16 (1 KiB to spare) and does 5
      tile products a block pair instead of 6, holding 160 float32 registers of
      gradients a thread (its spills: docs/kernels.md): 395 and 437 TFLOP/s causal and
      not, against the wide design's 290 and 302.
    ordered_dq_adds: the design of ``deterministic=True``. False: dK/dV without dQ, then
      a dQ kernel of its own (7 tile products a block pair; head dims up to
      `SPLIT_KEYS_HEAD_DIM`, its K/V ring). True: the atomic design's one kernel, each
      query block's dQ adds put in a fixed order (FlashAttention-3's deterministic
      backward): key tiles add their chunk of a query block from the last key tile
      down, each waiting on a counter in global memory until the tiles after it have
      added theirs (`last_key_tiles`). The CTAs launch in that order (the last key tile
      first), so every tile waited on has started; causal, the later key tiles reach a
      query block first. Any head dim the atomic design takes. None (`orders_dq_adds`):
      the dQ kernel where it takes the head dims, the ordered adds above. On an H100 at
      head dim 128 the ordered adds ran at 0.58x the atomic default where the dQ kernel
      runs at 0.86x (`benchmarks/results/tuning/attention_backward_ordered_h100.md`); at
      2x8192x16x256 they ran at 273 TFLOP/s against the Triton backward's 179, which
      took those calls before, and the atomic default's 369
      (`attention_backward_deterministic_h256_h100.md`).
    dq_writer_warp: in the split-keys design with dQ added in the kernel (the atomic
      default and ``ordered_dq_adds``), a consumer stages its dQ chunk in shared memory
      and signals a barrier, and one warp of the producer warpgroup sends the chunks out
      by TMA reductions (and, ordered, waits for the later key tiles' adds and counts
      its own), as FlashAttention-3's backward does. Otherwise each consumer issues its
      chunk's reduction itself and waits for the last one to have left before staging
      the next: about 35 instructions of its step (docs/kernels.md, the SASS reading),
      and every wait of the ordered adds. Only where each consumer takes the same
      number of chunks every step, or at most one (`writes_dq_by_warp`). On the H200 it
      ran at 0.95x the consumers' own reductions causal and 0.99x on GQA 32/8
      (`benchmarks/results/tuning/attention_backward_writer_h200.md`), so False.
    dq_staging_tiles: with the writer warp, the staging tiles of each consumer (1 or 2),
      taken in turn: with two a consumer may stage a chunk while the writer still waits
      to send its last one, which with ``ordered_dq_adds`` waits for the later key
      tiles' adds. Two take 32 KiB more at block_q 64: bfloat16 at head dim 128 then
      has 1 KiB to spare; where they do not fit, one (`staging_tiles`). With the ordered
      adds on the H200, two ran level with the dQ kernel causal and at 0.77x on GQA
      (`attention_backward_writer_h200.md`); without them, on an H100, level with one
      tile (`attention_backward_writer_h100.md`).
    l2_sections: the order in which the dK/dV kernel's CTAs take their (batch, head
      of the grid, key tile), the grid's heads being the K/V heads times the group's
      split (`group_split`): in sections of the fewest heads whose CTAs make about a
      wave (`l2_section`), the head fastest within a section, then the key tile, then
      the section and the batch row, so that the CTAs resident together read the Q, dO
      and dQ of few query heads. Otherwise the head fastest, then the key tile, then the
      batch: on causal GQA 32/8 each CTA walks its group's 4 query heads, its time on
      each shorter the later its keys, so the CTAs resident together drift over all 32
      heads of a batch row, 128 MB of Q, dO and float32 dQ against the 50 MB of L2; Nsight
      Compute read an L2 hit rate of 81% against FlashAttention-3's 91%
      (`benchmarks/results/tuning/ncu_attention_backward_gqa32x8_defaults_h100.log`).
      `benchmarks/launch_order.py` models both orders (LRU over the blocks of Q, dO and
      dQ, every CTA's steps, one CTA an SM): 79% against 94% hits there, with today's
      order finishing at the bound and a wave-sized section too. Sections sized instead
      to 40 MB (FlashAttention-3's rule; two K/V heads on GQA 32/8) finish 1.11x the
      bound in the model, the longest key tiles of the last sections starting late, and
      timed 0.92x on an H100 (`attention_backward_writer_h100.md`). Wave-sized ones
      timed 0.93x on GQA 32/8, 0.97-0.99x on the other causal rows but 1.03x at 1x16384
      (`attention_backward_l2_waves_h100.md`): the kernel is not waiting on memory
      (docs/kernels.md, `l2_sections`), so False. Both orders above are as the
      design meant them, the grid's first axis fastest; the lowering launches its last
      axis fastest (batch rows, then key tiles, heads slowest), so the timings stand but
      the orders they timed were not these; modelled in the launch order, the default
      reads 94% and the sections 79% (docs/kernels.md, the CTAs' order).
    late_dq: in the split-keys design with the consumers' own dQ reductions, at head dim
      128 (one chunk each a step), without a causal mask or a window
      (`takes_late_dq`), each consumer computes its chunk of a step's dQ in the next
      step, issued right after that step's Sᵀ, so that the tensor cores run it while
      the consumer waits for Sᵀ and computes Pᵀ, and the consumers meet at the exchange
      of dSᵀ a step after writing it rather than at once. Otherwise a step issues Sᵀ
      and waits for it with nothing else queued: on an H100 our consumers spent 24% of
      their stall samples waiting on wgmma results against 13.5% in FlashAttention-3's
      (the first wait of a step, on Sᵀ, 5% of all samples, causal;
      `benchmarks/results/tuning/ncu_attention_backward_causal_*_h100.stalls.log`).
      Offline, ptxas spills nothing without a mask at 4x4096 (8 and 12 bytes at
      T = 1000, 16/16 and 32/8 heads) but 132 causal, where it also serializes the
      wgmma (docs/kernels.md). Timed on an H100 beside the default's order in one run
      (`attention_backward_late_dq_h100.md`): 572 against 557 TFLOP/s at 4x4096, 595
      against 565 at 1x16384, 565 against 566 on GQA 32/8 (non-causal), so True.
    late_dq_banded: `late_dq` with a causal mask or a window too, in the steps without
      element masks only: a masked step computes its own dQ in the step, and the last
      step of each run of unmasked steps has its chunk computed right after the run, so
      that no masked step holds a pending dQ product beside its mask. Offline, causal,
      ptxas spills 4 bytes at 4x4096 (as each step's own dQ) and 56 on GQA 32/8 and
      32/4 (against 64 and 68), and serializes no wgmma (docs/kernels.md). Timed with
      `one_producer_warp` below.
    one_producer_warp: the producer's loads (of both kernels) issued by its first warp
      alone (`on_warps`), the other three skipping to the kernel's end, rather than by
      the whole warpgroup, whose four warps then each run the loads' loop and poll its
      barriers: on an H100 our kernel kept 11.7 warps an SM active against
      FlashAttention-3's 9.8, whose idle producer warps leave, and ran about 28 M
      warp-instructions in the producer of its 325 M, causal at 4x4096
      (`ncu_attention_backward_causal_*_h100.log`). With the writer warp the loads
      always take one warp. Timed on an H100 in two runs beside each other
      (`benchmarks/results/tuning/attention_backward_lateband_warp1_h100.md`), with
      `late_dq_banded`, causal: 526 and 527 TFLOP/s against 502 and 503 at 4x4096,
      640 and 624 against 606 and 585 at 1x16384, 524 against 512 at 4x4096 32/32;
      level on GQA 32/8 and at head dim 64, 0.99x and 1.06x on GQA 32/4 at 2x8192 (the
      two runs' spread); on causal MHA either alone gained less or lost. So both True.
    heads_per_cta: GQA: at most how many query heads of a K/V head's group each dK/dV
      CTA walks (None: all of them). Past it the group is split over the fewest CTAs
      that bring each to at most this many heads (`group_split`). Causal, key tile k
      sees query blocks 2k and after, so in a walk over many heads the CTAs resident
      together drift apart by head and read Q and dO over more of the group than L2
      holds (docs/kernels.md); fewer heads a CTA keep them closer. Each CTA's dK and
      dV are then partial sums, which it adds into zeroed float32 arrays by TMA
      reductions, 64 columns at a time through its dQ staging tile, as dQ's chunks are
      (and as FlashAttention-3's GQA backward adds its CTAs', one head a CTA).
      Only in the atomic split-keys design without the writer warp. Swept on an H100
      (`benchmarks/results/tuning/attention_backward_gqa_sweep_h100.md`): causal with 8
      or 16 heads a group, 4 heads a CTA ran 1.19-1.39x the whole group's walk (554
      against 464 TFLOP/s at 2x8192 32/4, 490 against 389 at 4x4096 32/4, 530 against
      382 at 2x8192 64/4), level with 1 and 2 heads (within 4%); at 4 or 2 heads a
      group, splitting lost up to 10% (one head a CTA: 476 against 505 at 4x4096 32/8),
      and without a mask and at head dim 64 (8x2048 32/4) 4 heads ran level with the
      whole group. Offline, ptxas spills 4 bytes at one head a CTA (the loop over
      heads is gone), 68 at two, against the whole group's 56 (2x8192 32/4 causal).
      So 4. (Walking the query blocks from the last down, every head at each block,
      aimed at the same drift; it ran 0.90-0.93x the head-by-head walk and was
      removed: docs/kernels.md.)
  """

  block_q: int = 64
  block_kv: int = 64
  num_stages: int = 2
  fresh_tile_addresses: bool = True
  fresh_mask_offsets: bool | None = None
  fa3_step_order: bool | None = None
  split_keys_width: int = 192 + 128  # MLA's head dims
  ordered_dq_adds: bool | None = None
  dq_writer_warp: bool = False
  dq_staging_tiles: int = 1
  l2_sections: bool = False
  late_dq: bool = True
  late_dq_banded: bool = True
  one_producer_warp: bool = True
  heads_per_cta: int | None = 4

  def __post_init__(self):
    if self.dq_staging_tiles not in (1, 2):
      raise ValueError("HopperBackwardBlockSizes.dq_staging_tiles must be 1 or 2, got "
                       f"{self.dq_staging_tiles!r}")
    if self.heads_per_cta is not None and self.heads_per_cta < 1:
      raise ValueError("HopperBackwardBlockSizes.heads_per_cta must be None or at least 1, "
                       f"got {self.heads_per_cta!r}")

  def fa3_order(self, head_dim: int, value_head_dim: int) -> bool:
    """Whether the split-keys consumers take `fa3_step_order` at these padded head
    dims: as set, or by default past 2 · `SPLIT_KEYS_HEAD_DIM`."""
    if self.fa3_step_order is not None:
      return self.fa3_step_order
    return head_dim + value_head_dim > 2 * SPLIT_KEYS_HEAD_DIM

  def takes_fresh_mask_offsets(self, heads_walked: int) -> bool:
    """Whether the masked steps take `fresh_mask_offsets` in a CTA that walks
    ``heads_walked`` query heads: as set, or by default where that is more than one."""
    if self.fresh_mask_offsets is not None:
      return self.fresh_mask_offsets
    return heads_walked > 1

  def orders_dq_adds(self, head_dim: int, value_head_dim: int) -> bool:
    """Whether deterministic calls take `ordered_dq_adds` at these padded head dims: as
    set, or by default where the dQ kernel cannot, past `SPLIT_KEYS_HEAD_DIM`."""
    if self.ordered_dq_adds is not None:
      return self.ordered_dq_adds
    return max(head_dim, value_head_dim) > SPLIT_KEYS_HEAD_DIM

  def writes_dq_by_warp(self, head_dim: int, wide: bool) -> bool:
    """Whether `dq_writer_warp` applies at this padded head dim: in the split-keys design,
    where the consumers take the same number of dQ chunks a step (head dim 128: one
    each, staged without a branch), or one chunk between them (64). With a branch per
    chunk, ptxas serialized the kernel's wgmma instructions at 128 ("insufficient
    register resources", read offline). MLA's 192 (three chunks) keeps the consumers'
    own reductions: there ptxas serializes the wgmma with or without the writer, which
    spilled 168 bytes causal where the consumers' reductions spill 144."""
    n_chunks = head_dim // _CHUNK
    return (self.dq_writer_warp and not wide
            and (n_chunks % _CONSUMERS == 0 or n_chunks == 1))

  def takes_late_dq(self, head_dim: int, value_head_dim: int, wide: bool, ordered: bool,
                    banded: bool) -> bool:
    """Whether `late_dq` applies at these padded head dims: in the split-keys design in
    its own step order (not `fa3_order`), with the consumers' own reductions (neither
    ordered adds nor the writer warp), where each consumer takes one chunk of dQ a step
    (head dim 128), so that its chunk's columns are computed at run time with no
    branch around the product, and not ``banded`` (a causal mask or a window), where
    ptxas spilled half of dK's or dV's accumulator in every step (offline), unless
    `late_dq_banded` (then in the unmasked steps only)."""
    return (self.late_dq and not wide and not ordered
            and (not banded or self.late_dq_banded)
            and head_dim // _CHUNK == _CONSUMERS
            and not self.writes_dq_by_warp(head_dim, wide)
            and not self.fa3_order(head_dim, value_head_dim))

  def group_split(self, group: int, deterministic: bool, head_dim: int, wide: bool) -> int:
    """The CTAs over which each K/V head's group of ``group`` query heads is split: the
    fewest that divide the group into at most `heads_per_cta` heads each; 1 where that
    is unset, with ``deterministic`` (the partial sums' order would vary), in the
    ``wide`` design or with the writer warp at this padded ``head_dim`` (where a
    consumer has no staging tile of its own for the partial sums)."""
    heads = self.heads_per_cta
    if heads is None or deterministic or wide or self.writes_dq_by_warp(head_dim, wide):
      return 1
    return next(split for split in range(1, group + 1)
                if group % split == 0 and group // split <= heads)

  def keys_per_tile(self, wide: bool) -> int:
    """Keys per CTA: each consumer's own block_kv, or one block_kv shared by both in the
    wide design (`wide`)."""
    return self.block_kv * (1 if wide else _CONSUMERS)

  def wide(self, head_dim: int, value_head_dim: int, itemsize: int, terms: int) -> bool:
    """Whether the dK/dV kernel takes the wide design at these padded head dims: a
    consumer holds dK (block_kv x head_dim) and dV (block_kv x value_head_dim) in float32
    registers only up to `split_keys_width`; past 2 · `SPLIT_KEYS_HEAD_DIM`, only where
    that design's shared memory fits (not float16's two dS terms at 192 + 128) and
    neither head dim exceeds 192. (256 + 64 and 64 + 256 would fit, but ptxas spills 640
    and 384 bytes there against MLA's 144, and neither has been timed.)"""
    width = head_dim + value_head_dim
    if width > self.split_keys_width:
      return True
    if width <= 2 * SPLIT_KEYS_HEAD_DIM:
      return False
    if max(head_dim, value_head_dim) > 192:
      return True
    return self._smem_bytes(False, head_dim, value_head_dim, itemsize, terms) > SMEM_BYTES

  def smem_bytes(self, head_dim: int, value_head_dim: int, itemsize: int, terms: int) -> int:
    """Shared memory of the dK/dV kernel at these (padded) head dims of Q/K and of V/dO:
    K and V, the Q/dO ring with its row statistics, the dSᵀ buffers (`ds_buffers`,
    ``terms`` float16 terms each), the dQ chunks on their way out (one per consumer
    taking dQ, `dq_staging_tiles` with the writer warp), and 1 KiB for barriers and
    alignment."""
    wide = self.wide(head_dim, value_head_dim, itemsize, terms)
    tiles = self.staging_tiles(head_dim, value_head_dim, itemsize, terms)
    return self._smem_bytes(wide, head_dim, value_head_dim, itemsize, terms, tiles)

  def staging_tiles(self, head_dim: int, value_head_dim: int, itemsize: int,
                    terms: int) -> int:
    """The dQ staging tiles of each consumer at these padded head dims:
    `dq_staging_tiles` where the writer warp takes dQ (`writes_dq_by_warp`) and they fit
    shared memory, else 1."""
    wide = self.wide(head_dim, value_head_dim, itemsize, terms)
    tiles = self.dq_staging_tiles
    if tiles == 1 or not self.writes_dq_by_warp(head_dim, wide):
      return 1
    needed = self._smem_bytes(wide, head_dim, value_head_dim, itemsize, terms, tiles)
    return tiles if needed <= SMEM_BYTES else 1

  def _smem_bytes(self, wide: bool, head_dim: int, value_head_dim: int, itemsize: int,
                  terms: int, staging_tiles: int = 1) -> int:
    keys = self.keys_per_tile(wide)
    kv = keys * (head_dim + value_head_dim) * itemsize
    ring = self.num_stages * (self.block_q * (head_dim + value_head_dim) * itemsize
                              + 2 * self.block_q * 4)
    ds = ds_buffers(wide, terms) * terms * keys * self.block_q * itemsize
    dq = (1 if wide else _CONSUMERS * staging_tiles) * self.block_q * _CHUNK * 4
    return kv + ring + ds + dq + 1024


BLOCKS = HopperBackwardBlockSizes()


def l2_section(heads: int, key_tiles: int, sm_count: int) -> int:
  """Heads of the grid (of ``heads``, each with ``key_tiles`` CTAs) per launch section of
  `l2_sections`: the fewest that divide ``heads`` and whose CTAs make `L2_SECTION_WAVE`
  of a wave of ``sm_count``; all where none does. A section of a wave starts its longest
  causal key tiles together, and the CTAs of the next ones fill in as the short ones
  finish: the order of longest first holds across sections, and the resident CTAs read
  few heads (`benchmarks/launch_order.py` models it)."""
  return next(section for section in range(1, heads + 1) if heads % section == 0
              and (section * key_tiles >= L2_SECTION_WAVE * sm_count or section == heads))


def dq_chunk_owner(step_index, c):
  """The consumer that takes chunk c of the dQ of its step_index-th step in the
  split-keys design: consumer (step + c) mod 2, so that both take some each step (in the
  wide design consumer 0 takes every chunk)."""
  return rem32(step_index + c, _CONSUMERS)


def staged_dq_chunks(step_index, wg, n_chunks: int):
  """The chunks of dQ consumer ``wg`` stages for the writer warp in its step_index-th
  step (`dq_chunk_owner`'s), as (chunk, predicate): one chunk between the consumers is
  staged where the predicate holds; of an even count each consumer takes chunks
  (step + wg) mod 2, + 2, ... at a column offset computed at run time, with no predicate
  (None): a branch per chunk made ptxas serialize the kernel's wgmma
  (`HopperBackwardBlockSizes.writes_dq_by_warp`)."""
  if n_chunks == 1:
    return [(0, dq_chunk_owner(step_index, 0) == wg)]
  first = rem32(step_index + wg, _CONSUMERS)
  return [(first + j * _CONSUMERS, None) for j in range(n_chunks // _CONSUMERS)]


def dq_staging_tile(step_index, j: int, n_chunks: int, tiles: int):
  """Which of its ``tiles`` staging tiles (`dq_staging_tiles`, 1 or 2) a consumer stages
  its j-th chunk of its step_index-th step's dQ in (`staged_dq_chunks`' order): its
  chunks take them in turn. Of an even count of chunks each consumer takes half every
  step; of one chunk, the step's owner (`dq_chunk_owner`), every other step. A mask, not
  a remainder: the step index is never negative, and it costs one instruction."""
  if tiles == 1:
    return 0
  per_step = n_chunks // _CONSUMERS
  sequence = step_index * per_step + j if per_step else lax.shift_right_logical(
      step_index, 1)
  return lax.bitwise_and(sequence, tiles - 1)


def ds_buffers(wide: bool, terms: int) -> int:
  """Buffers of dSᵀ in shared memory, so that a query block's may be written while the
  products of the one before still read theirs: two, but one of float16's two terms in
  the wide design (whose shared memory holds no more; a barrier then orders them)."""
  return 1 if wide and terms > 1 else 2


def unsupported(head_dim: int, dtype, deterministic: bool = False,
                value_head_dim: int | None = None,
                blocks: HopperBackwardBlockSizes | None = None) -> str | None:
  """Why the Hopper backward (with ``blocks``, the module's `BLOCKS` unless given)
  cannot run these head dims (of Q/K; of V, ``head_dim`` unless given) and dtype, or
  None."""
  blocks = BLOCKS if blocks is None else blocks
  value_head_dim = head_dim if value_head_dim is None else value_head_dim
  widest = max(head_dim, value_head_dim)
  if wgmma_head_dim(widest) > MAX_HEAD_DIM:
    return f"the Hopper backward takes head dims up to {MAX_HEAD_DIM}, got {widest}"
  if (deterministic
      and not blocks.orders_dq_adds(wgmma_head_dim(head_dim), wgmma_head_dim(value_head_dim))
      and wgmma_head_dim(widest) > SPLIT_KEYS_HEAD_DIM):
    return (f"the deterministic Hopper backward takes head dims up to "
            f"{SPLIT_KEYS_HEAD_DIM} (its dQ kernel's K/V ring), got {widest}")
  needed = blocks.smem_bytes(wgmma_head_dim(head_dim), wgmma_head_dim(value_head_dim),
                             jnp.dtype(dtype).itemsize, score_grad_term_count(dtype))
  if needed > SMEM_BYTES:
    return f"it needs {needed} bytes of shared memory, more than {SMEM_BYTES}"
  return None



def _cols(x, shape):
  """A per-query vector broadcast along the keys (rows) of an Sᵀ tile."""
  return lax.broadcast_in_dim(x, shape, [1])


def _key_segments(kv_seg_ref, b, key0, shape):
  """The segment ids of an Sᵀ tile's keys [key0, key0 + rows), broadcast along its
  queries (None without segments)."""
  if kv_seg_ref is None:
    return None
  return lax.broadcast_in_dim(
      plgpu.load(kv_seg_ref.at[b, pl.ds(key0, shape[0])], layout=_ROW, optimized=False),
      shape, [0])


def _probabilities(k_tile, q_tile, lse2_tile, logits: Logits, mask=None):
  """Pᵀ = 2^(Sᵀ · c - lse₂) of Sᵀ = K Qᵀ (a row per key, a column per query), and the
  tanh of the capped scores for dS (None without a cap). ``mask``: a function giving the
  allowed pairs, for the blocks that need one."""
  shape = (k_tile.shape[0], q_tile.shape[0])

  def scores(acc):
    plgpu.wgmma(acc, k_tile, q_tile.T)
    return acc[...]

  return _scores_to_probabilities(pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32)),
                                  lse2_tile, logits, mask)


def _scores_to_probabilities(qk, lse2_tile, logits: Logits, mask=None):
  """`_probabilities` from the tile's products qk = K Qᵀ."""
  x, tanh = logits.cap(qk)
  lse2 = plgpu.load(lse2_tile, layout=_COL)
  p = jnp.exp2(x * (logits.factor * LOG2E) - _cols(lse2, x.shape))
  return (p if mask is None else jnp.where(mask(), p, 0.0)), tanh


def _score_grad_operands(p, dp, tanh, delta_tile, dtype):
  """dSᵀ = Pᵀ ∘ (dPᵀ - delta) (`logits.score_grad`) as wgmma operands of ``dtype``
  (`logits.score_grad_terms`), delta read from its ring slot along the queries."""
  delta = plgpu.load(delta_tile, layout=_COL)
  return score_grad_terms(score_grad(p, dp, _cols(delta, p.shape), tanh), dtype)


def _block_mask(spec: MaskSpec, shape, q0, key0, kv_length, q_seg_ref, b, k_seg):
  """A function giving the allowed pairs of the Sᵀ tile of keys [key0, ...) and queries
  [q0, ...): for `_probabilities`, which calls it after the scores."""
  def allowed():
    q_seg = None
    if q_seg_ref is not None:
      q_seg = _cols(plgpu.load(q_seg_ref.at[b, pl.ds(q0, shape[1])], layout=_COL,
                               optimized=False), shape)
    return element_mask(spec, q0 + wgmma_iota(shape, 1), key0 + wgmma_iota(shape, 0), kv_length,
                        q_seg, k_seg)
  return allowed


def _key_tile_ranges(spec: MaskSpec, k0, keys: int, bq: int, kv_length, q_length):
  """The query block ranges (`masks.query_block_ranges`) of the key tile [k0, k0 + keys).
  A tile that reaches past the key length (or past S) masks every block: dQ sums over
  its keys, and dK, dV of keys past the length must come out 0, so theirs must have
  probability 0 everywhere."""
  lo, full_lo, full_hi, hi = query_block_ranges(
      spec, k0, bq, keys, kv_length, q_length, pl.cdiv(spec.q_len, bq))
  keys_end = spec.kv_len if kv_length is None else jnp.minimum(kv_length, spec.kv_len)
  partial = k0 + keys > keys_end
  return lo, jnp.where(partial, hi, full_lo), jnp.where(partial, hi, full_hi), hi


def last_key_tiles(spec: MaskSpec, keys: int, bq: int, n_kv_tiles: int, n_q_blocks: int,
                   kv_length, q_length, batch: int):
  """(batch, n_q_blocks) int32: the last key tile of ``keys`` keys whose CTA adds into
  each query block of bq rows' dQ (-1 where none does), by `_key_tile_ranges`, for
  ``ordered_dq_adds``. The tiles that add into a block are consecutive (a tile's first
  query block, and its end, never decrease with its keys, and tiles past the key length
  add into none), so tile t of them waits for last - t adds before its own
  (tests/test_attention.py checks the run on every mask)."""
  tiles = jnp.arange(n_kv_tiles, dtype=jnp.int32)

  def last(kv_len, q_len):
    lo, _, _, hi = (jnp.broadcast_to(x, tiles.shape)[None, :]  # unmasked: scalars
                    for x in _key_tile_ranges(spec, tiles * keys, keys, bq, kv_len, q_len))
    i = jnp.arange(n_q_blocks, dtype=jnp.int32)[:, None]
    adds = (lo <= i) & (i < hi)  # (query block, key tile)
    return jnp.max(jnp.where(adds, tiles[None, :], -1), axis=1)

  return jax.vmap(last, axis_size=batch)(kv_length, q_length)  # None: no batch axis


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *refs, aux_present,
                 spec: MaskSpec, blocks: HopperBackwardBlockSizes, logits: Logits,
                 group: int, atomic_dq: bool, float32_grads: bool, k_smem,
                 v_smem, q_ring, do_ring, lse2_ring, delta_ring, kv_loaded, q_loaded,
                 do_loaded, slot_free, key_tiles: int | None = None, ds_smem=None,
                 dq_smem=None, ds_ready=None, ds_free=None, done=None,
                 dq_staged=None, dq_free=None,
                 dq_order_shape: tuple[int, int, int] | None = None,
                 section: int | None = None, grid_heads: int | None = None,
                 group_split: int = 1):
  """dK and dV of a key tile; with ``atomic_dq`` also its share of dQ, added into the
  float32 dQ ref (the last input). ``float32_grads``: dK and dV leave in float32, stored
  from registers (their arrays padded to whole key tiles), instead of through K and V's
  shared memory in the inputs' dtype. Head dims above `SPLIT_KEYS_HEAD_DIM` take the
  wide design (`ds_free` given; k_smem and v_smem hold one block of keys). With
  ``dq_order_shape`` (`ordered_dq_adds`: (B, N, query blocks), the shape of the
  counters of the chunks added into each query block's dQ; the input before dQ is
  `last_key_tiles`' table; ``key_tiles`` CTAs along the keys) the key tiles add into each
  query block in a fixed order, the last first. With ``dq_staged`` and ``dq_free`` (a
  barrier per consumer: `dq_writer_warp`) the consumers stage their dQ chunks and a warp
  of the producer warpgroup adds them into dQ. ``section``: the heads of the
  grid (of ``grid_heads``: the K/V heads times ``group_split``) of a launch section,
  where the CTAs take their tiles in `l2_sections`' order (the grid's last axis then
  runs over batch rows and sections).
  ``group_split`` (`heads_per_cta`): the CTAs of each K/V head's group, the grid's head
  axis running over both; each adds its partial dK and dV into the zeroed float32 refs
  dk_ref and dv_ref (the last inputs, after dQ's)."""
  aux_refs, refs = AuxArrays.split_refs(refs, aux_present)
  q_len_ref, kv_len_ref, q_seg_ref, kv_seg_ref = aux_refs.lengths_and_segments
  ordered = dq_order_shape is not None
  writer = dq_staged is not None
  staging_tiles = dq_smem.shape[0] // _CONSUMERS if writer else 1  # `staging_tiles`
  # The counters are shared by every CTA, so they come from pl.get_global: semaphores
  # among the kernel's scratch are each CTA's own (Pallas gives each block its slice),
  # and with them every wait for another tile's adds hung. Pallas zeroes them at each
  # call.
  dq_order = pl.get_global(plgpu.SemaphoreType.REGULAR(dq_order_shape)) if ordered else None
  last_ref, *refs = refs if ordered else (None, *refs)
  dq_ref, dk_ref, dv_ref = refs if atomic_dq else (None, *refs)

  bq, bkv, stages = blocks.block_q, blocks.block_kv, blocks.num_stages
  head_dim, value_dim = k_smem.shape[-1], v_smem.shape[-1]
  n_chunks = head_dim // _CHUNK  # of dQ, as wide as Q and K
  key_blocks = k_smem.shape[0]  # blocks of block_kv keys the CTA holds
  wg = lax.axis_index("wg")
  b, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
  key_tile = lax.axis_index("kv_tiles")
  if section is not None:  # the grid's axes: a section's heads, key tiles, sections
    per_batch = grid_heads // section
    kv_head = rem32(b, per_batch) * section + kv_head
    b = div32(b, per_batch)
  if ordered:  # the last key tile launches first: those waited on have started
    key_tile = key_tiles - 1 - key_tile
  heads = group // group_split  # the query heads this CTA walks, from first_head
  first_head = kv_head * group
  if group_split > 1:
    share = rem32(kv_head, group_split)
    kv_head = div32(kv_head, group_split)
    first_head = kv_head * group + share * heads
  k0 = key_tile * (key_blocks * bkv)
  q_length = None if q_len_ref is None else q_len_ref[b]
  kv_length = None if kv_len_ref is None else kv_len_ref[b]
  ranges = _key_tile_ranges(spec, k0, key_blocks * bkv, bq, kv_length, q_length)
  lo, hi = ranges[0], ranges[3]
  blocks_per_head = hi - lo

  banded = spec.is_causal or spec.window_left is not None or spec.window_right is not None
  shared_grads = group_split > 1  # dK and dV added with the group's other CTAs

  def walk_steps(step, masked_apart=True, after_unmasked=None):
    """``step(i, n, step_index, s, masked=...)`` for every query block i of every query
    head n the CTA walks, head by head, the step_index-th step of the CTA, in ring slot
    s; ``after_unmasked(n, step_index)``, where given, after each head's unmasked steps,
    with the last one's step_index. ``masked_apart=False`` (the producer's loads, which
    need no mask) walks each head's blocks in one loop, every step with masked=False."""
    def walk_head(g, carry):
      def block(i, carry, *, masked: bool):
        step_index = g * blocks_per_head + i - lo
        step(i, first_head + g, step_index, rem32(step_index, stages), masked=masked)
        return carry

      def after_interior(carry):
        after_unmasked(first_head + g, g * blocks_per_head + ranges[2] - 1 - lo)
        return carry

      if masked_apart:
        return walk_block_ranges(ranges, block, carry,
                                 None if after_unmasked is None else after_interior)
      return lax.fori_loop(lo, hi, functools.partial(block, masked=False), carry)
    lax.fori_loop(0, heads, walk_head, 0)

  def add_dq_chunk(acc_fn, staging, i, n, c, wait=True):
    """Chunk c (64 head-dim columns) of dQ for query block i of head n, from the product
    ``acc_fn`` accumulates, added into the float32 dQ by TMA through ``staging``; where
    ``ordered``, after every chunk of the later key tiles (`signal_dq_adds`), which it
    waits for unless ``wait`` is False (a chunk of the block has waited already)."""
    dq = pl.run_scoped(functools.partial(acc_fn, columns=pl.ds(c * _CHUNK, _CHUNK)),
                       plgpu.ACC((bq, _CHUNK), jnp.float32))
    send_dq_chunk(dq, staging, i, n, c, wait=ordered and wait)

  def stage(staging, value):
    """``value`` into the float32 tile ``staging``, once its last TMA add has read it,
    made visible to the next TMA."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk has left
    staging[...] = value
    plgpu.commit_smem()

  def send_dq_chunk(dq, staging, i, n, c, wait=False):
    """Adds ``dq``, chunk c of query block i of head n's dQ, into the float32 dQ by TMA
    through ``staging``; with ``wait`` (the ordered adds), after every chunk of the
    later key tiles."""
    stage(staging, dq)
    if wait:  # the tiles after this one that add into block i are done
      later_adds = jnp.maximum(last_ref[b, i] - key_tile, 0) * n_chunks
      plgpu.semaphore_wait(dq_order.at[b, n, i], later_adds, decrement=False,
                           memory_scope="gpu")
    plgpu.copy_smem_to_gmem(staging, dq_ref.at[b, pl.ds(i * bq, bq), n,
                                                pl.ds(c * _CHUNK, _CHUNK)],
                            reduction_op="add")

  def staging(owner, step_index, j):
    """The staging tile, with its barriers' index, of the j-th chunk consumer ``owner``
    stages in its step_index-th step (`dq_staging_tile`)."""
    return owner * staging_tiles + dq_staging_tile(step_index, j, n_chunks, staging_tiles)

  def stage_dq_chunk(acc_fn, tile, c):
    """Chunk c of dQ, from the product ``acc_fn`` accumulates, staged in this consumer's
    staging tile ``tile`` for the writer warp (`dq_writer`). It waits for the writer to
    have sent the tile's last chunk out before the product, not after it: ptxas spilled
    the product's 32 registers a thread around a wait placed between product and
    store."""
    plgpu.barrier_wait(dq_free.at[tile])
    dq = pl.run_scoped(functools.partial(acc_fn, columns=pl.ds(c * _CHUNK, _CHUNK)),
                       plgpu.ACC((bq, _CHUNK), jnp.float32))
    dq_smem.at[tile][...] = dq
    plgpu.commit_smem()  # visible to the writer's TMA
    plgpu.barrier_arrive(dq_staged.at[tile])

  def dq_writer():
    """The writer warp of `dq_writer_warp`: for each step of the walk, in the consumers'
    order, each chunk of dQ staged by the consumer that owns it (`dq_chunk_owner`) is added
    into the float32 dQ by a TMA reduction, and its staging tile handed back once read.
    Ordered, a step's chunks wait for the later key tiles' adds into the query block
    (`last_key_tiles`) and, once landed, count as this tile's."""
    for tile in range(_CONSUMERS * staging_tiles):  # the staging tiles start free
      plgpu.barrier_arrive(dq_free.at[tile])

    def step(i, n, step_index, s, *, masked: bool):
      del s, masked
      rows = pl.ds(i * bq, bq)
      if ordered:
        later_adds = jnp.maximum(last_ref[b, i] - key_tile, 0) * n_chunks
        plgpu.semaphore_wait(dq_order.at[b, n, i], later_adds, decrement=False,
                             memory_scope="gpu")
      for c in range(n_chunks):
        # The owner's chunks of a step are c mod 2, + 2, ...: this is its (c // 2)-th.
        tile = staging(dq_chunk_owner(step_index, c), step_index, c // _CONSUMERS)
        plgpu.barrier_wait(dq_staged.at[tile])
        plgpu.copy_smem_to_gmem(dq_smem.at[tile],
                                dq_ref.at[b, rows, n, pl.ds(c * _CHUNK, _CHUNK)],
                                reduction_op="add")
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.barrier_arrive(dq_free.at[tile])
      if ordered:
        plgpu.wait_smem_to_gmem(0)  # the adds have landed
        plgpu.semaphore_signal(dq_order.at[b, n, i], n_chunks, memory_scope="gpu")

    walk_steps(step)
    plgpu.wait_smem_to_gmem(0)  # the last adds have landed before the CTA ends

  def owns_chunk(step_index, c):
    """Whether this consumer takes chunk c of its step_index-th step's dQ
    (`dq_chunk_owner`)."""
    return dq_chunk_owner(step_index, c) == wg

  def signal_dq_adds(i, n, step_index):
    """Counts the chunks of dQ this consumer added in its step_index-th step, that of
    query block i of head n, in ``dq_order`` once they have landed: called a step later,
    before the next adds, so that the wait for them seldom stalls. One counter a block,
    not a chunk: each wait and signal costs registers (at head dim 256, four waits a
    step spilled 132 bytes, one 20). The counts are constants (Mosaic GPU signals no
    other): all chunks in the wide design, else half, and of an odd count one more for
    the consumer with chunk 0."""
    plgpu.wait_smem_to_gmem(0)  # every add this consumer issued has landed

    def signal(count):
      if count:
        plgpu.semaphore_signal(dq_order.at[b, n, i], count, memory_scope="gpu")

    if ds_free is not None or n_chunks % 2 == 0:
      signal(n_chunks if ds_free is not None else n_chunks // 2)
    else:
      first = owns_chunk(step_index, 0)
      pl.when(first)(lambda: signal(n_chunks // 2 + 1))
      pl.when(jnp.logical_not(first))(lambda: signal(n_chunks // 2))

  def previous_step(i, n):
    """(query block, head) of the step before that of query block i of head n: block
    i - 1 of the head, or the last block of the head before (selects, where division
    would cost registers ptxas then spills)."""
    first = i == lo
    return jnp.where(first, hi - 1, i - 1), jnp.where(first, n - 1, n)

  def signal_previous_dq_adds(i, n, step_index):
    """`signal_dq_adds` of the step before that of query block i of head n."""
    pl.when(step_index > 0)(lambda: signal_dq_adds(*previous_step(i, n), step_index - 1))

  def last_step():
    """(query block, head) of the CTA's last step: the last block of its last head."""
    return hi - 1, first_head + heads - 1

  def signal_last_dq_adds():
    """`signal_dq_adds` of the CTA's last step, once the walk is done."""
    steps = heads * blocks_per_head
    pl.when(steps > 0)(lambda: signal_dq_adds(*last_step(), steps - 1))

  def leave(grad, tile, grad_ref, keys):
    """Sends a consumer's gradient of the CTA's ``keys`` out: added in float32 with the
    group's other CTAs' (``shared_grads``) through the consumer's dQ staging tile; from
    registers in float32; else through its input's tile in shared memory (``tile``, K's
    or V's, which every product has finished reading) in the inputs' dtype."""
    rows = (b, keys, kv_head)
    if shared_grads:
      for c in range(grad.shape[1] // _CHUNK):
        stage(dq_smem.at[wg], grad[:, c * _CHUNK:(c + 1) * _CHUNK])
        plgpu.copy_smem_to_gmem(dq_smem.at[wg],
                                grad_ref.at[(*rows, pl.ds(c * _CHUNK, _CHUNK))],
                                reduction_op="add")
    elif float32_grads:
      grad_ref.at[rows][...] = grad
    else:
      tile[...] = grad.astype(tile.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tile, grad_ref.at[rows])

  def key_block(c):
    """Block c of the CTA's keys in k_smem and v_smem, its index behind an optimization
    barrier with `fresh_tile_addresses` in the split-keys design, so that each step
    addresses its K and V tiles afresh (see `HopperBackwardBlockSizes`)."""
    fresh = blocks.fresh_tile_addresses and ds_free is None
    return lax.optimization_barrier(jnp.int32(c)) if fresh else c

  def wide_consumers():
    """Head dims above `SPLIT_KEYS_HEAD_DIM`: both consumers take Pᵀ of the CTA's
    block_kv keys; consumer 0 accumulates dV and takes dQ, consumer 1 computes dPᵀ and
    dSᵀ, hands dSᵀ over through shared memory and accumulates dK. Each holds one float32
    gradient of block_kv x head_dim (128 registers a thread at 256), and each block pair
    costs 6 tile products (Sᵀ twice) where the split-keys design takes 5."""
    k_tile, v_tile = k_smem.at[0], v_smem.at[0]
    shape = (bkv, bq)
    n_buffers, terms = ds_smem.shape[0], ds_smem.shape[1]
    k_seg = _key_segments(kv_seg_ref, b, k0, shape)
    keys = pl.ds(k0, bkv)
    plgpu.barrier_wait(kv_loaded)

    def probabilities(i, s, masked):
      plgpu.barrier_wait(q_loaded.at[s])
      mask = (_block_mask(spec, shape, i * bq, k0, kv_length, q_seg_ref, b, k_seg)
              if masked else None)
      return _probabilities(k_smem.at[key_block(0)], q_ring.at[s],
                            lse2_ring.at[s], logits, mask)

    def finish(grad, tile, grad_ref):
      if not float32_grads:  # the other consumer is done reading this tile
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)
      leave(grad, tile, grad_ref, keys)
      plgpu.wait_smem_to_gmem(0)  # and the last dQ chunk has left

    @pl.when(wg == 0)
    def _values():
      def compute(dv_acc):
        def step(i, n, step_index, s, *, masked: bool):
          p, _ = probabilities(i, s, masked)
          plgpu.barrier_wait(do_loaded.at[s])
          plgpu.wgmma(dv_acc, p.astype(do_ring.dtype), do_ring.at[s])
          plgpu.wgmma_wait(0)  # dV's product has read dO
          plgpu.barrier_arrive(slot_free.at[s])
          buf = rem32(step_index, n_buffers)
          plgpu.barrier_wait(ds_ready.at[buf])
          if ordered:
            signal_previous_dq_adds(i, n, step_index)
          k_step = k_smem.at[key_block(0)]

          def chunk(acc, *, columns):
            for t in range(terms):
              plgpu.wgmma(acc, ds_smem.at[buf, t].T, k_step.at[:, columns])
            return acc[...]

          for c in range(n_chunks):
            add_dq_chunk(chunk, dq_smem, i, n, c, wait=c == 0)
          plgpu.barrier_arrive(ds_free.at[buf])  # the chunks' products have read dSᵀ

        walk_steps(step)
        if ordered:
          signal_last_dq_adds()
        return dv_acc[...]

      finish(pl.run_scoped(compute, plgpu.ACC((bkv, value_dim), jnp.float32)), v_tile,
             dv_ref)

    @pl.when(wg == 1)
    def _keys():
      def compute(dk_acc):
        def step(i, n, step_index, s, *, masked: bool):
          p, tanh = probabilities(i, s, masked)
          plgpu.barrier_wait(do_loaded.at[s])

          def value_grads(acc):
            plgpu.wgmma(acc, v_smem.at[key_block(0)], do_ring.at[s].T)
            return acc[...]

          dp = pl.run_scoped(value_grads, plgpu.ACC(shape, jnp.float32))
          ds_terms = _score_grad_operands(p, dp, tanh, delta_ring.at[s], q_ring.dtype)
          buf = rem32(step_index, n_buffers)
          pl.when(step_index >= n_buffers)(lambda: plgpu.barrier_wait(ds_free.at[buf]))
          for t, term in enumerate(ds_terms):
            ds_smem.at[buf, t][...] = term
          plgpu.commit_smem()  # dSᵀ visible to consumer 0's products
          plgpu.barrier_arrive(ds_ready.at[buf])
          for term in ds_terms:
            plgpu.wgmma(dk_acc, term, q_ring.at[s])
          plgpu.wgmma_wait(0)  # dK's product has read Q
          plgpu.barrier_arrive(slot_free.at[s])

        walk_steps(step)
        return dk_acc[...]

      finish(pl.run_scoped(compute, plgpu.ACC((bkv, head_dim), jnp.float32)) * logits.scale,
             k_tile, dk_ref)

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
    if ds_free is not None:
      wide_consumers()
      return
    key0 = k0 + wg * bkv  # this consumer's keys
    k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
    shape = (bkv, bq)
    k_seg = _key_segments(kv_seg_ref, b, key0, shape)
    fa3_order = blocks.fa3_order(head_dim, value_dim)
    fresh_offsets = blocks.takes_fresh_mask_offsets(heads)
    late = atomic_dq and blocks.takes_late_dq(head_dim, value_dim, False, ordered, banded)
    # With a mask band (`late_dq_banded`) only the unmasked steps take dQ a step late:
    # each run of them starts at query block full_lo and ends with a flush of its last.
    full_lo, full_hi = ranges[1], ranges[2]
    plgpu.barrier_wait(kv_loaded)

    def compute(dk_acc, dv_acc):
      def step(i, n, step_index, s, *, masked: bool):
        """The products of query block i of query head n."""
        q_tile, do_tile = q_ring.at[s], do_ring.at[s]
        own = key_block(wg)
        k_own, v_own = k_smem.at[own], v_smem.at[own]
        mask = None
        if masked:
          keys = lax.optimization_barrier(key0) if fresh_offsets else key0
          mask = _block_mask(spec, shape, i * bq, keys, kv_length, q_seg_ref, b, k_seg)
        late_here = late and not (banded and masked)
        if fa3_order:
          plgpu.barrier_wait(q_loaded.at[s])
          plgpu.barrier_wait(do_loaded.at[s])

          def products(s_acc, dp_acc):
            plgpu.wgmma(s_acc, k_own, q_tile.T)
            plgpu.wgmma(dp_acc, v_own, do_tile.T)
            qk = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)  # Sᵀ; dPᵀ may still run
            p, tanh = _scores_to_probabilities(qk, lse2_ring.at[s], logits, mask)
            dp = plgpu.wgmma_accumulator_load(dp_acc, wait_n=0)
            return p.astype(do_tile.dtype), _score_grad_operands(
                p, dp, tanh, delta_ring.at[s], q_tile.dtype)

          p16, ds_terms = pl.run_scoped(products, plgpu.ACC(shape, jnp.float32),
                                        plgpu.ACC(shape, jnp.float32))
          plgpu.wgmma(dv_acc, p16, do_tile)
        else:
          plgpu.barrier_wait(q_loaded.at[s])
          if late_here:
            p, tanh = probabilities_beside_last_dq(i, n, step_index, s, k_own, mask)
          else:
            p, tanh = _probabilities(k_own, q_tile, lse2_ring.at[s], logits, mask)
          plgpu.barrier_wait(do_loaded.at[s])

          def value_grads(acc):
            plgpu.wgmma(acc, v_own, do_tile.T)
            plgpu.wgmma(dv_acc, p.astype(do_tile.dtype), do_tile)
            return plgpu.wgmma_accumulator_load(acc, wait_n=1)  # dPᵀ; dV may still run

          dp = pl.run_scoped(value_grads, plgpu.ACC(shape, jnp.float32))
          ds_terms = _score_grad_operands(p, dp, tanh, delta_ring.at[s], q_tile.dtype)
        for term in ds_terms:
          plgpu.wgmma(dk_acc, term, q_tile)
        if late_here:
          hand_over_ds(step_index, ds_terms)
        elif atomic_dq:
          query_grads(i, n, step_index, ds_terms, own)
        plgpu.wgmma_wait(0)  # dK's product has read Q
        plgpu.barrier_arrive(slot_free.at[s])

      def hand_over_ds(step_index, ds_terms):
        """This consumer's half of the step's dSᵀ, into shared memory for both
        consumers' dQ products (of this step, or with `late_dq` of the next), and the
        buffer it went to."""
        buf = rem32(step_index, 2)
        for t, term in enumerate(ds_terms):
          ds_smem.at[buf, t, wg][...] = term
        plgpu.commit_smem()  # dSᵀ visible to both consumers' products
        plgpu.barrier_arrive(ds_ready.at[buf])
        return buf

      def last_dq_product(step_index, acc, has_previous):
        """Issues this consumer's chunk of the dQ of its step before step_index (`late_dq`)
        into ``acc``, once both halves of that step's dSᵀ are in shared memory, and
        returns the chunk's index. Where ``has_previous`` is false there is no such step
        to take: the product reads whatever the buffer holds, and nothing sends it."""
        # step_index + 1 has the parity of the step before and is never negative.
        buf = rem32(step_index + 1, 2)
        pl.when(has_previous)(lambda: plgpu.barrier_wait(ds_ready.at[buf]))
        (c, _), = staged_dq_chunks(step_index + 1, wg, n_chunks)
        dq_product(acc, buf, key_halves(key_block(wg)), pl.ds(c * _CHUNK, _CHUNK))
        return c

      def key_halves(own):
        """Both consumers' blocks of the CTA's keys, this consumer's (``own``,
        `key_block`) first."""
        return (own, 1 - own) if blocks.fresh_tile_addresses else range(_CONSUMERS)

      def dq_product(acc, buf, halves, columns):
        """Issues dQ's ``columns`` = dS K over the CTA's keys (the blocks ``halves``) into
        ``acc``, from both consumers' dSᵀ in buffer ``buf``."""
        for t in range(ds_smem.shape[1]):
          for half in halves:  # both consumers' keys
            plgpu.wgmma(acc, ds_smem.at[buf, t, half].T, k_smem.at[half, :, columns])

      def probabilities_beside_last_dq(i, n, step_index, s, k_own, mask):
        """`_probabilities` of the step, with this consumer's chunk of the step before's
        dQ issued right after Sᵀ: the tensor cores run it while Pᵀ is computed, and it
        leaves once Pᵀ is (`late_dq`). With a mask band the step before is taken only
        within the run of unmasked steps (from query block full_lo)."""
        if banded:
          has_previous, previous = i > full_lo, (i - 1, n)
        else:
          has_previous, previous = step_index > 0, previous_step(i, n)

        def send(dq, c):
          pl.when(has_previous)(lambda: send_dq_chunk(dq, dq_smem.at[wg], *previous, c))

        def products(s_acc, dq_acc):
          plgpu.wgmma(s_acc, k_own, q_ring.at[s].T)
          c = last_dq_product(step_index, dq_acc, has_previous)
          qk = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)  # Sᵀ; the dQ chunk may run
          p, tanh = _scores_to_probabilities(qk, lse2_ring.at[s], logits, mask)
          send(plgpu.wgmma_accumulator_load(dq_acc, wait_n=0), c)
          return p, tanh

        return pl.run_scoped(products, plgpu.ACC(shape, jnp.float32),
                             plgpu.ACC((bq, _CHUNK), jnp.float32))

      def flush_dq(i, n, step_index):
        """The dQ chunk of the step_index-th step, query block i of head n, where no next
        step computes it: the walk's last step, or with a mask band the last of a run of
        unmasked steps."""
        def product(acc):
          c = last_dq_product(step_index + 1, acc, True)
          return plgpu.wgmma_accumulator_load(acc, wait_n=0), c

        dq, c = pl.run_scoped(product, plgpu.ACC((bq, _CHUNK), jnp.float32))
        send_dq_chunk(dq, dq_smem.at[wg], i, n, c)

      def last_step_dq():
        """`flush_dq` of the walk's last step."""
        steps = heads * blocks_per_head
        pl.when(steps > 0)(lambda: flush_dq(*last_step(), steps - 1))

      def flush_unmasked_run(n, step_index):
        """`flush_dq` of the last of head n's unmasked steps, where it has any."""
        pl.when(full_hi > full_lo)(lambda: flush_dq(full_hi - 1, n, step_index))

      def query_grads(i, n, step_index, ds_terms, own):
        """This consumer's chunks of dQ for query block i of head n: dSᵀ goes to shared
        memory, and once both consumers' halves are there, dQ = dS K over the CTA's keys
        in 64-column chunks, each added into the float32 dQ by TMA. ``own``: this
        consumer's block of the CTA's keys (`key_block`)."""
        if ordered and not writer:
          signal_previous_dq_adds(i, n, step_index)
        buf = hand_over_ds(step_index, ds_terms)
        plgpu.barrier_wait(ds_ready.at[buf])
        halves = key_halves(own)

        def chunk(acc, *, columns):
          dq_product(acc, buf, halves, columns)
          return acc[...]

        if writer:
          for j, (c, staged) in enumerate(staged_dq_chunks(step_index, wg, n_chunks)):
            tile = staging(wg, step_index, j)
            if staged is None:
              stage_dq_chunk(chunk, tile, c)
            else:
              pl.when(staged)(lambda c=c, tile=tile: stage_dq_chunk(chunk, tile, c))
        else:
          for c in range(n_chunks):  # a consumer's first chunk is 0 or 1: it waits there
            pl.when(owns_chunk(step_index, c))(lambda c=c: add_dq_chunk(
                chunk, dq_smem.at[wg], i, n, c, wait=c < _CONSUMERS))

      walk_steps(step, after_unmasked=flush_unmasked_run if late and banded else None)
      if ordered and not writer:
        signal_last_dq_adds()
      if late and not banded:
        last_step_dq()
      return dk_acc[...], dv_acc[...]

    dk, dv = pl.run_scoped(compute, plgpu.ACC((bkv, head_dim), jnp.float32),
                           plgpu.ACC((bkv, value_dim), jnp.float32))
    if atomic_dq and not float32_grads:  # both consumers are done reading each other's
      plgpu.barrier_arrive(done)  # K (the dQ products) before K and V take the
      plgpu.barrier_wait(done)  # gradients on their way out
    keys = pl.ds(key0, bkv)
    leave(dk * logits.scale, k_tile, dk_ref, keys)
    leave(dv, v_tile, dv_ref, keys)
    plgpu.wait_smem_to_gmem(0)  # and the last dQ chunk has left

  def loads():
    """The producer's TMA loads: K and V of the CTA's keys, then Q with lse₂ and dO with
    delta of every step into the ring."""
    for c in range(key_blocks):
      rows = (b, pl.ds(k0 + c * bkv, bkv), kv_head)
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[c], kv_loaded)
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[c], kv_loaded)

    def step(i, n, step_index, s, *, masked: bool):
      del masked
      rows = pl.ds(i * bq, bq)
      pl.when(step_index >= stages)(lambda: plgpu.barrier_wait(slot_free.at[s]))
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, n], q_ring.at[s], q_loaded.at[s])
      plgpu.copy_gmem_to_smem(lse2_ref.at[b, n, rows], lse2_ring.at[s], q_loaded.at[s])
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, n], do_ring.at[s], do_loaded.at[s])
      plgpu.copy_gmem_to_smem(delta_ref.at[b, n, rows], delta_ring.at[s],
                              do_loaded.at[s])

    walk_steps(step, masked_apart=False)

  @pl.when(wg == _CONSUMERS)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
    if writer:
      on_warps(loads, dq_writer)
    else:
      producer_loads(loads, blocks.one_producer_warp)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *refs, aux_present,
               spec: MaskSpec, blocks: HopperBackwardBlockSizes, logits: Logits,
               group: int, float32_grads: bool, q_tile_count: int, q_tiles, do_tiles,
               k_ring, v_ring, q_loaded, k_loaded, v_loaded, k_free, v_free):
  """dQ of a query tile (the deterministic backward's second kernel): the forward's
  layout (a producer streaming K/V blocks, two consumers of block_q rows each), with
  S = Q Kᵀ, P, dP = dO Vᵀ, dS and dQ += dS K per key block. ``float32_grads`` as
  `_dkdv_kernel`; ``q_tile_count``: the grid's query tiles."""
  aux_refs, (dq_ref,) = AuxArrays.split_refs(refs, aux_present)
  q_len_ref, kv_len_ref, q_seg_ref, kv_seg_ref = aux_refs.lengths_and_segments
  bq, bkv, stages = blocks.block_q, blocks.block_kv, blocks.num_stages
  wg = lax.axis_index("wg")
  b, n = lax.axis_index("batch"), lax.axis_index("heads")
  q_tile_index = lax.axis_index("q_tiles")
  if spec.is_causal:
    # Later tiles walk more key blocks: launched first, as the forward's grid launches
    # them, the short ones fill in at the end. The grid's order, shortest first, left
    # the last SM 3-7% past the bound on issue 30's causal rows, against 0.1-1.3%
    # (a model of the launch, benchmarks/launch_order.py --dq).
    q_tile_index = q_tile_count - 1 - q_tile_index
  q0 = q_tile_index * (_CONSUMERS * bq)
  q_length = None if q_len_ref is None else q_len_ref[b]
  kv_length = None if kv_len_ref is None else kv_len_ref[b]
  ranges = key_block_ranges(spec, q0, _CONSUMERS * bq, bkv, kv_length, q_length)
  lo, hi = ranges[0], ranges[3]

  def slot(j):
    return rem32(j - lo, stages)

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
    row0 = q0 + wg * bq
    q_tile, do_tile = q_tiles.at[wg], do_tiles.at[wg]
    shape = (bq, bkv)
    rows = pl.ds(row0, bq)
    lse2 = per_row(plgpu.load(lse2_ref.at[b, n, rows], layout=_ROW, optimized=False), shape)
    delta = per_row(plgpu.load(delta_ref.at[b, n, rows], layout=_ROW, optimized=False),
                  shape)
    q_seg = None
    if q_seg_ref is not None:
      q_seg = per_row(plgpu.load(q_seg_ref.at[b, rows], layout=_ROW, optimized=False), shape)
    plgpu.barrier_wait(q_loaded.at[wg])

    def compute(dq_acc):
      def step(j, carry, *, masked: bool):
        s = slot(j)
        plgpu.barrier_wait(k_loaded.at[s])

        def scores(acc):
          plgpu.wgmma(acc, q_tile, k_ring.at[s].T)
          return acc[...]

        x, tanh = logits.cap(pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32)))
        p = jnp.exp2(x * (logits.factor * LOG2E) - lse2)
        if masked:
          k_seg = None
          if kv_seg_ref is not None:
            k_seg = lax.broadcast_in_dim(
                plgpu.load(kv_seg_ref.at[b, pl.ds(j * bkv, bkv)], layout=_COL,
                           optimized=False), shape, [1])
          allowed = element_mask(spec, row0 + wgmma_iota(shape, 0), j * bkv + wgmma_iota(shape, 1),
                                 kv_length, q_seg, k_seg)
          p = jnp.where(allowed, p, 0.0)
        plgpu.barrier_wait(v_loaded.at[s])

        def value_grads(acc):
          plgpu.wgmma(acc, do_tile, v_ring.at[s].T)
          return acc[...]

        dp = pl.run_scoped(value_grads, plgpu.ACC(shape, jnp.float32))
        plgpu.barrier_arrive(v_free.at[s])
        for term in score_grad_terms(score_grad(p, dp, delta, tanh), q_tile.dtype):
          plgpu.wgmma(dq_acc, term, k_ring.at[s])
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(k_free.at[s])
        return carry

      walk_block_ranges(ranges, step, 0)
      return dq_acc[...]

    dq = pl.run_scoped(compute, plgpu.ACC(q_tile.shape, jnp.float32))
    if float32_grads:
      dq_ref.at[b, rows, n][...] = dq * logits.scale
      return
    q_tile[...] = (dq * logits.scale).astype(q_tile.dtype)  # no product reads Q now
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[b, rows, n])
    plgpu.wait_smem_to_gmem(0)

  def loads():
    for c in range(_CONSUMERS):
      rows = (b, pl.ds(q0 + c * bq, bq), n)
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_tiles.at[c], q_loaded.at[c])
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_tiles.at[c], q_loaded.at[c])
    kv_head = div32(n, group)

    @pl.loop(lo, hi)
    def _(j):
      s = slot(j)
      rows = (b, pl.ds(j * bkv, bkv), kv_head)
      pl.when(j - lo >= stages)(lambda: plgpu.barrier_wait(k_free.at[s]))
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_ring.at[s], k_loaded.at[s])
      pl.when(j - lo >= stages)(lambda: plgpu.barrier_wait(v_free.at[s]))
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_ring.at[s], v_loaded.at[s])

  @pl.when(wg == _CONSUMERS)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
    producer_loads(loads, blocks.one_producer_warp)


def backward(q, k, v, o, m, log2_l, do, aux_arrays, *, spec: MaskSpec, scale: float,
             softcap: float | None, deterministic: bool = False, grad_dtype=None,
             delta=None, blocks: HopperBackwardBlockSizes | None = None):
  """(dq, dk, dv) in the inputs' dtype, from the forward's inputs (bfloat16 or float16),
  its output o (float32 where the forward wrote one) and row statistics m and log2_l
  (B, N, T); ``aux_arrays`` as the forward takes them. ``deterministic``: dQ the same
  from run to run, by ``blocks.orders_dq_adds``' design: from a kernel of its own (7
  tile products per block pair instead of 5), or by atomic adds in a fixed order.
  ``grad_dtype=jnp.float32``: the gradients in float32 (partial gradients that are
  summed afterwards, as context parallelism's); ``delta``: rowsum(dO ∘ O) (B, N, T)
  where the caller has it (then o is not read). ``blocks``: the module's `BLOCKS`
  unless given, read at each call so that a sweep (HOPPER_BWD_SCHEDULES in
  benchmarks/bench_attention_backward.py) or a test may replace it."""
  blocks = BLOCKS if blocks is None else blocks
  float32_grads = grad_dtype is not None and jnp.dtype(grad_dtype) == jnp.float32
  if grad_dtype is not None and not float32_grads and jnp.dtype(grad_dtype) != q.dtype:
    raise ValueError(f"grad_dtype must be float32 or the inputs' {q.dtype}, got {grad_dtype}")
  B, T, N, H = q.shape
  S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
  H_pad, Hv_pad = wgmma_head_dim(H), wgmma_head_dim(Hv)
  why = unsupported(H, q.dtype, deterministic, value_head_dim=Hv, blocks=blocks)
  if why is not None:
    raise ValueError(why)
  terms = score_grad_term_count(q.dtype)
  ordered = deterministic and blocks.orders_dq_adds(H_pad, Hv_pad)
  atomic_dq = ordered or not deterministic
  wide = blocks.wide(H_pad, Hv_pad, q.dtype.itemsize, terms)
  if wide and blocks.num_stages != 2:
    raise ValueError(f"the Hopper backward's wide design (head dims {H}, {Hv}) takes "
                     f"num_stages=2, got {blocks.num_stages}")
  bq, bkv = blocks.block_q, blocks.block_kv
  keys_per_tile = blocks.keys_per_tile(wide)
  key_blocks = keys_per_tile // bkv
  logits = Logits(scale, softcap, fused=True)
  # delta = rowsum(dO ∘ O) from a kernel whose sums round alike whatever the batch
  # (`triton.delta`: under vmap, too), and lse₂ in one fused XLA pass, padded to whole
  # tiles of queries: the padding rows have lse₂ = +inf, so they take no part.
  T_pad = pl.cdiv(T, _CONSUMERS * bq) * _CONSUMERS * bq
  if delta is None:
    delta = row_delta(o, do, rows=T_pad)
  c = logits.factor * LOG2E
  lse2 = jnp.where(m == -jnp.inf, jnp.inf, m * c + log2_l)
  delta, lse2 = pad_to(delta, 2, T_pad), pad_to(lse2, 2, T_pad, jnp.inf)
  # TMA moves (8, 64) tiles: sequences padded to a multiple of 8 rows, the head dim to
  # one of 64, as in the forward (zeros, which change no product).
  T8, S8 = -(-T // 8) * 8, -(-S // 8) * 8
  q, do = pad_to(pad_to(q, 1, T8), 3, H_pad), pad_to(pad_to(do, 1, T8), 3, Hv_pad)
  k, v = pad_to(pad_to(k, 1, S8), 3, H_pad), pad_to(pad_to(v, 1, S8), 3, Hv_pad)
  q_len, kv_len, q_seg, kv_seg = aux_arrays.lengths_and_segments
  n_kv_tiles = pl.cdiv(S, keys_per_tile)
  if q_seg is not None:  # vector loads from global memory have no bounds
    q_seg = pad_to(q_seg, 1, T_pad, -1)
    kv_seg = pad_to(kv_seg, 1, n_kv_tiles * keys_per_tile, -2)
  aux = AuxArrays(q_len, kv_len, q_seg, kv_seg)
  aux_inputs = tuple(a for a in aux if a is not None)

  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  stages = blocks.num_stages
  statics = dict(aux_present=AuxArrays(*aux).present, spec=spec, blocks=blocks,
                 logits=logits, group=N // K, float32_grads=float32_grads)
  scratch = dict(
      k_smem=plgpu.SMEM((key_blocks, bkv, H_pad), k.dtype, transforms=tiled),  # then dK
      v_smem=plgpu.SMEM((key_blocks, bkv, Hv_pad), v.dtype, transforms=tiled),  # then dV
      q_ring=plgpu.SMEM((stages, bq, H_pad), q.dtype, transforms=tiled),
      do_ring=plgpu.SMEM((stages, bq, Hv_pad), do.dtype, transforms=tiled),
      lse2_ring=plgpu.SMEM((stages, bq), jnp.float32),
      delta_ring=plgpu.SMEM((stages, bq), jnp.float32),
      kv_loaded=plgpu.Barrier(num_arrivals=2 * key_blocks),  # K and V of every block
      q_loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # Q and lse₂
      do_loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # dO and delta
      slot_free=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
  )
  if wide:  # consumer 1 hands dSᵀ to consumer 0, which takes every chunk of dQ
    buffers = ds_buffers(wide, terms)
    scratch.update(
        ds_smem=plgpu.SMEM((buffers, terms, bkv, bq), q.dtype, transforms=tiled),
        dq_smem=plgpu.SMEM((bq, _CHUNK), jnp.float32),
        ds_ready=plgpu.Barrier(num_barriers=buffers),
        ds_free=plgpu.Barrier(num_barriers=buffers),  # consumer 0's products read it
        done=plgpu.Barrier(num_arrivals=_CONSUMERS),  # both done reading K and V
    )
  elif atomic_dq:
    tiles = _CONSUMERS * blocks.staging_tiles(H_pad, Hv_pad, q.dtype.itemsize, terms)
    scratch.update(
        ds_smem=plgpu.SMEM((2, terms, _CONSUMERS, bkv, bq), q.dtype, transforms=tiled),
        dq_smem=plgpu.SMEM((tiles, bq, _CHUNK), jnp.float32),  # chunks on their way out
        ds_ready=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=2),  # both halves of dSᵀ
        done=plgpu.Barrier(num_arrivals=_CONSUMERS),  # both consumers' dQ products done
    )
    if blocks.writes_dq_by_warp(H_pad, wide):  # a chunk staged for the writer warp, and sent
      scratch.update(dq_staged=plgpu.Barrier(num_barriers=tiles),
                     dq_free=plgpu.Barrier(num_barriers=tiles))
  # float32 gradients are stored from registers, with no bounds: whole tiles of rows.
  def kv_type(width):
    if float32_grads:
      return jax.ShapeDtypeStruct((B, n_kv_tiles * keys_per_tile, K, width), jnp.float32)
    return jax.ShapeDtypeStruct((B, S8, K, width), q.dtype)

  # Split over the group's CTAs (`heads_per_cta`), dK and dV are added into zeroed
  # float32 arrays the kernel aliases, as dQ is.
  split = blocks.group_split(N // K, deterministic, H_pad, wide)
  grid_heads = K * split

  order_inputs = ()
  if ordered:
    statics.update(key_tiles=n_kv_tiles, dq_order_shape=(B, N, T_pad // bq))
    order_inputs = (last_key_tiles(spec, keys_per_tile, bq, n_kv_tiles, T_pad // bq,
                                   kv_len, q_len, B),)
  # Pallas' Mosaic GPU lowering launches the grid's last axis fastest (CUDA's x): batch
  # rows, then key tiles, heads slowest (docs/kernels.md, the CTAs' order).
  grid = (("heads", grid_heads), ("kv_tiles", n_kv_tiles), ("batch", B))
  section = None
  if blocks.l2_sections:
    section = l2_section(grid_heads, n_kv_tiles, num_cores())
    grid = (("heads", section), ("kv_tiles", n_kv_tiles),
            ("batch", B * (grid_heads // section)))
  dkdv_kernel = warp_specialized_kernel(
      functools.partial(_dkdv_kernel, atomic_dq=atomic_dq, section=section, grid_heads=grid_heads,
                        group_split=split, **statics),
      out_type=() if split > 1 else (kv_type(H_pad), kv_type(Hv_pad)), consumers=_CONSUMERS,
      name="attention_backward_mosaic_gpu", softcap=softcap, scratch_types=scratch,
      grid=tuple(size for _, size in grid), grid_names=tuple(name for name, _ in grid))
  inputs = (q, k, v, do, lse2, delta, *aux_inputs)
  if not atomic_dq:
    dk, dv = dkdv_kernel(*inputs)
    dq = warp_specialized_kernel(
        functools.partial(_dq_kernel, q_tile_count=T_pad // (_CONSUMERS * bq), **statics),
        consumers=_CONSUMERS, name="attention_backward_dq_mosaic_gpu", softcap=softcap,
        out_type=jax.ShapeDtypeStruct((B, T_pad, N, H_pad), jnp.float32) if float32_grads
        else jax.ShapeDtypeStruct((B, T8, N, H_pad), q.dtype),
        scratch_types=dict(
            q_tiles=plgpu.SMEM((_CONSUMERS, bq, H_pad), q.dtype, transforms=tiled),
            do_tiles=plgpu.SMEM((_CONSUMERS, bq, Hv_pad), do.dtype, transforms=tiled),
            k_ring=plgpu.SMEM((stages, bkv, H_pad), k.dtype, transforms=tiled),
            v_ring=plgpu.SMEM((stages, bkv, Hv_pad), v.dtype, transforms=tiled),
            q_loaded=plgpu.Barrier(num_arrivals=2, num_barriers=_CONSUMERS),  # Q and dO
            k_loaded=plgpu.Barrier(num_barriers=stages),
            v_loaded=plgpu.Barrier(num_barriers=stages),
            k_free=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
            v_free=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
        ),
        grid=(N, T_pad // (_CONSUMERS * bq), B),
        grid_names=("heads", "q_tiles", "batch"),
    )(*inputs)
  else:
    # dQ is summed in place by every key tile's CTA: a zeroed float32 array it aliases.
    dq32 = jax.new_ref(jnp.zeros((B, T8, N, H_pad), jnp.float32))
    if split > 1:
      dk32, dv32 = (jax.new_ref(jnp.zeros((B, S8, K, width), jnp.float32))
                    for width in (H_pad, Hv_pad))
      dkdv_kernel(*inputs, *order_inputs, dq32, dk32, dv32)
      dk, dv = jax.freeze(dk32), jax.freeze(dv32)
    else:
      dk, dv = dkdv_kernel(*inputs, *order_inputs, dq32)
    dq = jax.freeze(dq32) * scale
    dq = dq if float32_grads else dq.astype(q.dtype)
  if split > 1 and not float32_grads:  # the group's float32 sums, in the inputs' dtype
    dk, dv = dk.astype(q.dtype), dv.astype(q.dtype)
  return dq[:, :T, :, :H], dk[:, :S, :, :H], dv[:, :S, :, :Hv]
