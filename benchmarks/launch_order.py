"""How the Hopper backward's launch order places its dK/dV CTAs, without a GPU: when the
last SM finishes, and how much of what the resident CTAs read L2 holds.

Each dK/dV CTA (a key tile of a batch row, for the query heads of its K/V head's group
that it walks: `group_split`) takes a step for every query block its keys see
(`masks.query_block_ranges`) of each of its query heads, head by head. The CTAs start
in the grid's launch order, its last axis fastest (Pallas' Mosaic GPU lowering puts it
on CUDA's x): batch rows, then key tiles, then the grid's heads (K/V heads times the
group's split); with `l2_sections`, the sections of a batch row, batch rows, key tiles,
then a section's heads (`l2_section`). Each starts on the first SM to free up, one CTA
an SM (384 threads at 168 registers).

Two models, per shape and order:

- finish: the last SM's finish against two lower bounds, the steps over the SMs and the
  longest CTA. Issue 30 asked whether launching the longest CTAs first would help the
  causal backward; a ratio near 1 says no.
- L2: every SM takes one step a tick, and each step reads the Q and dO block of its
  query rows and adds into their float32 dQ block, through an LRU cache of L2's size;
  the share of those bytes it finds there. Ours comes out at 94% on causal GQA 32/8,
  as does FlashAttention-3's order (a query head's key blocks fastest, one head a CTA),
  where Nsight Compute read 81% and 91% on an H100
  (`benchmarks/results/tuning/ncu_attention_backward_gqa32x8_defaults_h100.log`,
  `ncu_attention_backward_gqa_fa3_h100.log`): the model overstates the hits and does
  not tell the two apart. (Before 2026-12-07 it took the grid's first axis as the
  fastest, which gave ours 79%; docs/kernels.md, the CTAs' order.)

    python3 benchmarks/launch_order.py [--sms 132] [--overhead 4] [--l2-mib 50]

``--overhead``: a CTA's fixed cost (loading K and V, storing dK and dV) in steps.

``--dq``: the deterministic backward's dQ kernel instead (`dq_steps`), a CTA per query
tile, each as many steps as the key blocks it walks causal: the last SM's finish
against the bound with the grid's query tiles launched from the first (the shortest)
and, as the kernel launches them causal since 2026-12-08, from the last. On issue 30's
causal rows 1.032-1.073 the bound from the first, 1.001-1.013 from the last.

``--forward``: the Hopper forward's persistent CTAs instead (`forward._Work`), each item
(a tile of 128 query rows of a head and batch row) as many steps as the key blocks of
128 it walks causal (tile t: t + 1). The last CTA's finish against an even share, for
the fixed share (`_Work.item`) and for items claimed in `_Work.item_at`'s order by
whichever CTA is free first (`HopperBlockSizes.dynamic_schedule`), and how many
(batch row, query head) pairs the first wave of items walks (each pair reads its K/V
head's K and V). Then, for `_Work.item_at`'s order (the grid's launch order) and the
heads-fastest order it had until 2026-12-07 (`heads_fastest`): the L2 hits of K and V
(`forward_l2_hits`), and the finish with each item claimed as an SM frees up and with
each CTA claiming its next item as it starts one (`finish_claiming_ahead`, where the
kernel's claim sat until then).

- L2: 98% against 88% at 1x16384x16, equal on the rows of 64 or more pairs. Nsight
  Compute read 94.8% for the launch order, 77% heads fastest and 94% for the grid at
  1x16384 causal (`benchmarks/results/tuning/ncu_attention_forward_16k_causal_launch_h100.log`,
  `ncu_attention_forward_16k_causal_claimed_h100.log`,
  `ncu_attention_forward_16k_causal_grid_h100.log`).
- Claiming ahead, the launch order ends 1.085 and 1.086 an even share at 1x16384 and
  4x4096 (a CTA that starts one of a head's longest tiles holds the next long one too),
  against 1.003 and 1.016 heads fastest; Nsight Compute read elapsed cycles 1.093 and
  1.098 the SMs' active cycles for the launch order, 1.011 and 1.034 heads fastest
  (`ncu_attention_forward_4k_causal_launch_h100.log`,
  `ncu_attention_forward_4k_causal_claimed_h100.log`). Claimed as an SM frees up, both
  orders end within 1.6%.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq

import numpy as np

from jaxsoftmax.attention.masks import MaskSpec, key_block_ranges, query_block_ranges
from jaxsoftmax.attention.mosaic_gpu import backward as mosaic_backward
from jaxsoftmax.attention.mosaic_gpu import forward as mosaic_forward

# (B, T, N, K) at head dim 128, causal: issue 30's rows.
SHAPES = [(4, 4096, 16, 16), (1, 16384, 16, 16), (1, 32768, 16, 16), (4, 4096, 32, 8),
          (2, 8192, 32, 4), (8, 2048, 16, 16)]
HEAD_DIM = 128
# Bytes of a step's blocks: Q and dO in bfloat16, dQ in float32.
STEP_BYTES = {"q": 2 * HEAD_DIM, "do": 2 * HEAD_DIM, "dq": 4 * HEAD_DIM}  # a query row


@dataclasses.dataclass(frozen=True)
class Cta:
  batch: int
  heads: tuple[int, ...]  # the query heads it walks, in order
  lo: int  # its query blocks [lo, hi)
  hi: int

  @property
  def steps(self) -> int:
    return len(self.heads) * (self.hi - self.lo)


def ctas(B: int, T: int, N: int, K: int, causal: bool = True, blocks=None,
         sms: int = 132) -> list[Cta]:
  """The dK/dV CTAs in launch order, under ``blocks`` (the module's `BLOCKS` unless
  given)."""
  blocks = mosaic_backward.BLOCKS if blocks is None else blocks
  bq, keys = blocks.block_q, blocks.keys_per_tile(wide=False)
  group = N // K
  split = blocks.group_split(group, False, HEAD_DIM, False)
  grid_heads, tiles = K * split, -(-T // keys)
  section = (mosaic_backward.l2_section(grid_heads, tiles, sms) if blocks.l2_sections
             else grid_heads)  # today's order: one section of every head
  spec = MaskSpec(T, T, is_causal=causal)
  # Each tile's query blocks, the same in every batch row and section.
  ranges = [query_block_ranges(spec, tile * keys, bq, keys, None, None, -(-T // bq))
            for tile in range(tiles)]
  walked = group // split
  # The grid (a section's heads, key tiles, batch rows times sections) launches its last
  # axis fastest: the sections of a batch row, then the batch rows, then key tiles, then
  # a section's heads (see the module's docstring).
  order = []
  for head_in_section in range(section):
    for lo, _, _, hi in ranges:
      for b in range(B):
        for first in range(0, grid_heads, section):
          kv_head, share = divmod(first + head_in_section, split)
          heads = tuple(kv_head * group + share * walked + j for j in range(walked))
          order.append(Cta(b, heads, int(lo), int(hi)))
  return order


def cta_steps(B: int, T: int, N: int, K: int, causal: bool = True) -> list[int]:
  """Each dK/dV CTA's steps, in launch order (the module's `BLOCKS`)."""
  return [cta.steps for cta in ctas(B, T, N, K, causal)]


def finish(steps: list[int], sms: int, overhead: int) -> int:
  """The last SM's finish when each CTA starts on the first SM free, in launch order."""
  free = [0] * sms
  end = 0
  for s in steps:
    start = heapq.heappop(free)
    heapq.heappush(free, start + s + overhead)
    end = max(end, start + s + overhead)
  return end


def lower_bound(steps: list[int], sms: int, overhead: int) -> float:
  """No launch order finishes before this: the steps over the SMs, or the longest CTA
  (each with ``overhead``)."""
  return max((sum(steps) + overhead * len(steps)) / sms, max(steps) + overhead)


def finish_claiming_ahead(steps: list[int], sms: int) -> int:
  """The last SM's finish when each CTA starts with item ``cta`` of ``steps`` and claims
  its next item as it starts the one before, as the Hopper forward's claimed items did
  until 2026-12-07 (the claim sat among the item's first loads): a CTA that starts a
  long item holds the next one too, however long."""
  later = iter(steps[sms:])
  # (end of the CTA's current item, the CTA, the steps of the item it has claimed)
  ends = [(s, cta, next(later, None)) for cta, s in enumerate(steps[:sms])]
  heapq.heapify(ends)
  end = 0
  while ends:
    t, cta, claimed = heapq.heappop(ends)
    end = max(end, t)
    if claimed is not None:
      heapq.heappush(ends, (t + claimed, cta, next(later, None)))
  return end


class Lru:
  """An LRU cache of ``capacity`` bytes that counts the bytes read and those it held."""

  def __init__(self, capacity: int):
    self.capacity, self.blocks, self.held, self.hit, self.total = (
        capacity, collections.OrderedDict(), 0, 0, 0)

  def read(self, key, size: int):
    self.total += size
    if key in self.blocks:
      self.blocks.move_to_end(key)
      self.hit += size
      return
    self.blocks[key] = size
    self.held += size
    while self.held > self.capacity:
      self.held -= self.blocks.popitem(last=False)[1]

  @property
  def hits(self) -> float:
    return self.hit / max(self.total, 1)


def l2_hits(order: list[Cta], sms: int, l2_bytes: int, block_q: int) -> float:
  """The share of the bytes of Q, dO and dQ that the steps find in an LRU cache of
  ``l2_bytes``, every SM taking one step a tick and a CTA starting on an SM the tick
  after the last one there ended."""
  cache = Lru(l2_bytes)
  waiting = collections.deque(order)
  running = [None] * sms
  while True:
    busy = False
    for sm in range(sms):
      if not running[sm]:  # idle, or its CTA's steps are done
        running[sm] = None
        if waiting:
          cta = waiting.popleft()
          running[sm] = collections.deque(
              (cta.batch, n, i) for n in cta.heads for i in range(cta.lo, cta.hi))
      if not running[sm]:
        continue
      busy = True
      b, n, i = running[sm].popleft()
      for kind, row_bytes in STEP_BYTES.items():
        cache.read((kind, b, n, i), row_bytes * block_q)
    if not busy:
      return cache.hits


def items_at(work) -> list[tuple[int, int, int]]:
  """(b, n, tile) of each of the forward's items in `_Work.item_at`'s order."""
  return [tuple(int(x) for x in work.item_at(w)) for w in range(work.count)]


def heads_fastest(work) -> list[tuple[int, int, int]]:
  """(b, n, tile) of each of the forward's causal items heads fastest, then query tiles
  (the longest first), then batch rows: `_Work.item_at`'s order until 2026-12-07."""
  tiles = range(work.q_tiles - 1, -1, -1)
  return [(b, n, t) for b in range(work.batch) for t in tiles for n in range(work.heads)]


def forward_orders(B: int, T: int, N: int, sms: int) -> tuple[float, float, int, int]:
  """The causal forward at (B, T, N) on ``sms`` SMs: the last CTA's finish over an even
  share for the fixed share and for claimed items, and the (batch row, query head) pairs
  that the first ``sms`` items of each order walk."""
  tiles = -(-T // 128)
  work = mosaic_forward._Work(B, N, tiles, True, sms)
  even = B * N * tiles * (tiles + 1) / 2 / work.ctas
  fixed = max(sum(int(work.item(cta, i)[2]) + 1 for i in range(int(work.item_count(cta))))
              for cta in range(work.ctas))
  claimed = items_at(work)
  end = finish([t + 1 for _, _, t in claimed], work.ctas, 0)
  first_fixed = {tuple(int(x) for x in work.item(cta, 0)[:2]) for cta in range(work.ctas)}
  first_claimed = {(b, n) for b, n, _ in claimed[:work.ctas]}
  return fixed / even, end / even, len(first_fixed), len(first_claimed)


def forward_l2_hits(order: list[tuple[int, int, int]], N: int, K: int, sms: int,
                    l2_bytes: int, seed: int = 0) -> tuple[float, int]:
  """The causal forward's items (b, n, tile) taken in ``order`` by whichever of ``sms``
  SMs frees up first, each SM walking one key block (128 keys of K and V, bfloat16, head
  dim 128) a tick, the SMs of a tick in a random order: the share of the K and V bytes
  found in an LRU cache of ``l2_bytes``, and the ticks to the last SM's finish."""
  items = collections.deque(order)
  rng = np.random.default_rng(seed)
  block_bytes = 2 * 128 * HEAD_DIM * 2
  cache, tick = Lru(l2_bytes), 0
  running = [collections.deque() for _ in range(sms)]
  while True:
    busy = False
    for sm in rng.permutation(sms):
      if not running[sm] and items:
        b, n, tile = items.popleft()
        running[sm].extend((b, n // (N // K), j) for j in range(tile + 1))
      if not running[sm]:
        continue
      busy = True
      cache.read(running[sm].popleft(), block_bytes)
    if not busy:
      return cache.hits, tick
    tick += 1


def dq_steps(B: int, T: int, N: int, longest_first: bool, blocks=None) -> list[int]:
  """Each causal dQ CTA's steps (the key blocks its query tile walks:
  `masks.key_block_ranges`), in launch order: the deterministic backward's dQ kernel, a
  CTA per query tile of 2 · block_q rows of a batch row and query head, its grid (query
  heads, query tiles, batch rows) launched batch rows fastest. ``longest_first``: the
  query tiles from the last, as the kernel takes them under a causal mask."""
  blocks = mosaic_backward.BLOCKS if blocks is None else blocks
  rows = 2 * blocks.block_q
  spec = MaskSpec(T, T, is_causal=True)
  tiles = -(-T // rows)
  steps = []
  for _ in range(N):
    for t in range(tiles):
      tile = tiles - 1 - t if longest_first else t
      lo, _, _, hi = key_block_ranges(spec, tile * rows, rows, blocks.block_kv, None, None)
      steps += [int(hi - lo)] * B
  return steps


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sms", type=int, default=132)
  parser.add_argument("--overhead", type=int, default=4)
  parser.add_argument("--l2-mib", type=int, default=50)
  parser.add_argument("--forward", action="store_true")
  parser.add_argument("--dq", action="store_true")
  args = parser.parse_args()
  if args.dq:
    print("B, T, N causal: the dQ kernel's finish / max(steps / SMs, longest CTA), its "
          "query tiles launched from the first, then from the last")
    for B, T, N, _ in SHAPES:
      cells = []
      for longest_first in (False, True):
        steps = dq_steps(B, T, N, longest_first)
        end = finish(steps, args.sms, args.overhead)
        cells.append(f"{end / lower_bound(steps, args.sms, args.overhead):.3f}")
      print(f"{B}, {T}, {N}: " + ", ".join(cells), flush=True)
    return
  if args.forward:
    print("B, T, N causal: finish / even share, fixed share and claimed; (batch row, "
          "query head) pairs the first wave walks, fixed share and claimed")
    for B, T, N, _ in SHAPES:
      fixed, claimed, heads_fixed, heads_claimed = forward_orders(B, T, N, args.sms)
      print(f"{B}, {T}, {N}: {fixed:.3f}, {claimed:.3f}; {heads_fixed}, {heads_claimed}",
            flush=True)
    print("B, T, N/K causal: L2 hits of K and V, and the finish / even share with each "
          "item claimed as its SM frees up and with the next claimed as an item starts "
          "(finish_claiming_ahead); items in _Work.item_at's order (the grid's launch "
          "order: batch rows fastest, then query tiles, heads slowest), then heads "
          "fastest (heads_fastest)")
    for B, T, N, K in SHAPES:
      tiles = -(-T // 128)
      work = mosaic_forward._Work(B, N, tiles, True, args.sms)
      even = B * N * tiles * (tiles + 1) / 2 / args.sms
      cells = []
      for order in (items_at(work), heads_fastest(work)):
        hits, end = forward_l2_hits(order, N, K, args.sms, args.l2_mib * 2**20)
        ahead = finish_claiming_ahead([t + 1 for _, _, t in order], args.sms)
        cells.append(f"{hits:.1%}, {end / even:.3f}, {ahead / even:.3f}")
      print(f"{B}, {T}, {N}/{K}: " + "; ".join(cells), flush=True)
    return
  print("B, T, N/K causal, order: CTAs, finish / max(steps / SMs, longest CTA) in steps; "
        "L2 hits of Q, dO and dQ")
  for B, T, N, K in SHAPES:
    for name, sections in (("default", False), ("l2_sections", True)):
      blocks = dataclasses.replace(mosaic_backward.BLOCKS, l2_sections=sections)
      order = ctas(B, T, N, K, blocks=blocks, sms=args.sms)
      steps = [cta.steps for cta in order]
      bound = lower_bound(steps, args.sms, args.overhead)
      end = finish(steps, args.sms, args.overhead)
      hits = l2_hits(order, args.sms, args.l2_mib * 2**20, blocks.block_q)
      print(f"{B}, {T}, {N}/{K}, {name}: {len(steps)} CTAs, {end} / {bound:.0f} = "
            f"{end / bound:.3f}; L2 hits {hits:.1%}", flush=True)


if __name__ == "__main__":
  main()
