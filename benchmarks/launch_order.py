"""How the Hopper backward's launch order places its dK/dV CTAs, without a GPU: when the
last SM finishes, and how much of what the resident CTAs read L2 holds.

Each dK/dV CTA (a key tile of a batch row, for the query heads of its K/V head's group
that it walks: `group_split`) takes a step for every query block its keys see
(`masks.query_block_ranges`) of each of its query heads, head by head. The CTAs start
in the grid's order, the first axis fastest: the grid's heads (K/V heads times the
group's split), key tiles, batch; with `l2_sections`, a section's heads (`l2_section`),
key tiles, then sections and batch rows. Each starts on the first SM to free up, one
CTA an SM (384 threads at 168 registers).

Two models, per shape and order:

- finish: the last SM's finish against two lower bounds, the steps over the SMs and the
  longest CTA. Issue 30 asked whether launching the longest CTAs first would help the
  causal backward; a ratio near 1 says no.
- L2: every SM takes one step a tick, and each step reads the Q and dO block of its
  query rows and adds into their float32 dQ block, through an LRU cache of L2's size;
  the share of those bytes it finds there. FlashAttention-3's order (a query head's key
  blocks fastest, one head a CTA) comes out at 94% on causal GQA 32/8 and ours at 79%,
  as Nsight Compute read 91% and 81% on an H100
  (`benchmarks/results/tuning/ncu_attention_backward_gqa32x8_defaults_h100.log`,
  `ncu_attention_backward_gqa_fa3_h100.log`).

    python3 benchmarks/launch_order.py [--sms 132] [--overhead 4] [--l2-mib 50]

``--overhead``: a CTA's fixed cost (loading K and V, storing dK and dV) in steps.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq

import numpy as np

from jaxsoftmax.attention.masks import MaskSpec, query_block_ranges
from jaxsoftmax.attention.mosaic_gpu import backward as mosaic_backward

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
  order = []
  for b in range(B):
    for first in range(0, grid_heads, section):
      for lo, _, _, hi in ranges:
        for head in range(first, first + section):
          kv_head, share = divmod(head, split)
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


def l2_hits(order: list[Cta], sms: int, l2_bytes: int, block_q: int) -> float:
  """The share of the bytes of Q, dO and dQ that the steps find in an LRU cache of
  ``l2_bytes``, every SM taking one step a tick and a CTA starting on an SM the tick
  after the last one there ended."""
  cache, held, hit, total = collections.OrderedDict(), 0, 0, 0
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
        key, size = (kind, b, n, i), row_bytes * block_q
        total += size
        if key in cache:
          cache.move_to_end(key)
          hit += size
          continue
        cache[key] = size
        held += size
        while held > l2_bytes:
          held -= cache.popitem(last=False)[1]
    if not busy:
      return hit / max(total, 1)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sms", type=int, default=132)
  parser.add_argument("--overhead", type=int, default=4)
  parser.add_argument("--l2-mib", type=int, default=50)
  args = parser.parse_args()
  print("B, T, N/K causal, order: CTAs, finish / max(steps / SMs, longest CTA) in steps; "
        "L2 hits of Q, dO and dQ")
  for B, T, N, K in SHAPES:
    for name, sections in (("heads fastest", False), ("l2_sections", True)):
      blocks = dataclasses.replace(mosaic_backward.BLOCKS, l2_sections=sections)
      order = ctas(B, T, N, K, blocks=blocks, sms=args.sms)
      steps = [cta.steps for cta in order]
      work = np.sum(steps) + args.overhead * len(steps)
      bound = max(work / args.sms, max(steps) + args.overhead)
      end = finish(steps, args.sms, args.overhead)
      hits = l2_hits(order, args.sms, args.l2_mib * 2**20, blocks.block_q)
      print(f"{B}, {T}, {N}/{K}, {name}: {len(steps)} CTAs, {end} / {bound:.0f} = "
            f"{end / bound:.3f}; L2 hits {hits:.1%}", flush=True)


if __name__ == "__main__":
  main()
