"""How close the Hopper backward's launch order comes to the best schedule of its CTAs,
without a GPU: each dK/dV CTA (a K/V head's tile of keys in a batch row) takes a step for
every query block its keys see (`masks.query_block_ranges`) of every query head of its
group; the CTAs start in the grid's order, the first axis fastest (heads, key tiles,
batch; `mosaic_gpu/backward.py`), each on the first SM to free up, one CTA an SM (384
threads at 168 registers). Prints, per shape, the last SM's finish against two lower
bounds: the steps over the SMs, and the longest CTA. Issue 30 asked whether launching
the longest CTAs first would help the causal backward; a ratio near 1 says no.

    python3 benchmarks/launch_order.py [--sms 132] [--overhead 4]

``--overhead``: a CTA's fixed cost (loading K and V, storing dK and dV) in steps.
"""

from __future__ import annotations

import argparse
import heapq

import numpy as np

from jaxsoftmax.attention.masks import MaskSpec, query_block_ranges
from jaxsoftmax.attention.mosaic_gpu import backward as mosaic_backward

# (B, T, N, K) at head dim 128, causal: issue 30's rows.
SHAPES = [(4, 4096, 16, 16), (1, 16384, 16, 16), (1, 32768, 16, 16), (4, 4096, 32, 8),
          (2, 8192, 32, 4), (8, 2048, 16, 16)]


def cta_steps(B: int, T: int, N: int, K: int, causal: bool = True) -> list[int]:
  """Each dK/dV CTA's steps, in launch order."""
  blocks = mosaic_backward.BLOCKS
  bq, keys = blocks.block_q, blocks.keys_per_tile(wide=False)
  spec = MaskSpec(T, T, is_causal=causal)
  steps = []
  for _ in range(B):
    for tile in range(-(-T // keys)):
      lo, _, _, hi = query_block_ranges(spec, tile * keys, bq, keys, None, None,
                                        -(-T // bq))
      steps += [(N // K) * int(hi - lo)] * K  # the heads are the fastest axis
  return steps


def finish(steps: list[int], sms: int, overhead: int) -> int:
  """The last SM's finish when each CTA starts on the first SM free, in launch order."""
  free = [0] * sms
  end = 0
  for s in steps:
    start = heapq.heappop(free)
    heapq.heappush(free, start + s + overhead)
    end = max(end, start + s + overhead)
  return end


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sms", type=int, default=132)
  parser.add_argument("--overhead", type=int, default=4)
  args = parser.parse_args()
  print("B, T, N/K causal: CTAs, finish / max(steps / SMs, longest CTA) in steps")
  for B, T, N, K in SHAPES:
    steps = cta_steps(B, T, N, K)
    work = np.sum(steps) + args.overhead * len(steps)
    bound = max(work / args.sms, max(steps) + args.overhead)
    end = finish(steps, args.sms, args.overhead)
    print(f"{B}, {T}, {N}/{K}: {len(steps)} CTAs, {end} / {bound:.0f} = {end / bound:.3f}")


if __name__ == "__main__":
  main()
