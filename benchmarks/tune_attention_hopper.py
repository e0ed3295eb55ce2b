"""Sweeps the Hopper (Mosaic GPU) forward's HopperBlockSizes on the GPU, to set
`HopperBlockSizes.default`.

    PYTHONPATH=. python3 benchmarks/tune_attention_hopper.py --out benchmarks/results/tuning

bfloat16, forward alone. The impl column names the tiles: "q64 kv128 s2" (block_q per
consumer warpgroup, block_kv, num_stages), "persistent" when one CTA per SM walks the
work items, "one producer warp" when the producer's first warp alone issues the loads,
"overlap softmax" when each block's softmax runs under the previous block's P V;
the peers' rows (cuDNN, FlashAttention-3, tokamax, where installed) are the yardsticks.
Each tiling changes the head dim's default (`HopperBlockSizes.default`), its softmax
after each P V unless the tiling sets overlap_softmax; those that do not fit shared
memory at a head dim are rows that say so.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

import harness
import jaxsoftmax as js
from bench_attention import MORE_TARGET_SHAPES, TARGET_SHAPES, case_inputs, implementations
from jaxsoftmax.attention import HopperBlockSizes

# Issue 30's forward rows; the last (--only 6) head dim 64 causal, where the default is the
# grid launch (tune_attention_hopper_h64_h100.md).
SHAPES = TARGET_SHAPES + MORE_TARGET_SHAPES[:1]
SMOKE_SHAPES = [((1, 64, 2, 2, 64, True), jnp.bfloat16)]
# The softmax after each P V (overlap_softmax=False) unless a tiling says otherwise, so
# that the rows keep their meaning now that the default overlaps it above head dim 64.
TILINGS = [dict(persistent=False), dict(persistent=True), dict(num_stages=3, persistent=True),
           dict(one_producer_warp=True), dict(overlap_softmax=True),
           dict(overlap_softmax=True, persistent=True),
           # 256-key blocks, for head dim 64 (ptxas spills nothing there offline; above
           # head dim 64 two stages of them do not fit shared memory). Without a causal
           # mask the persistent one is head dim 64's default, whose 256-key blocks the
           # other tilings there inherit.
           dict(block_kv=256, persistent=False), dict(block_kv=256, persistent=True),
           # 128 query rows a consumer, for head dim 64: half the CTAs, each walking its
           # keys for twice the rows (ptxas spills nothing there offline with 64-key
           # blocks; with 128-key ones, 344 bytes causal). On an H100 they lost 0-12%
           # causal and 7-8% without a mask (tune_attention_hopper_h64_q128_h100.md).
           dict(block_q=128, block_kv=64, num_stages=2, persistent=False),
           dict(block_q=128, block_kv=64, num_stages=3, persistent=False),
           dict(block_q=128, block_kv=64, num_stages=2, persistent=True),
           # The persistent launch with its items claimed from a counter, on the
           # default's tiles (`HopperBlockSizes.dynamic_schedule`).
           dict(persistent=True, dynamic_schedule=True),
           dict(persistent=True, overlap_softmax=True, dynamic_schedule=True),
           dict(num_stages=3, persistent=True, dynamic_schedule=True)]
PEERS = ("cudnn", "fa3", "tokamax mosaic")
# TUNE_TILINGS="0,4" keeps only those of TILINGS (by index), to fit a device call.
if os.environ.get("TUNE_TILINGS"):
  TILINGS = [TILINGS[int(i)] for i in os.environ["TUNE_TILINGS"].split(",")]


def bench_shape(report: harness.Report, case, dtype):
  (q, k, v, _), common, flops = case_inputs(case, dtype)
  causal = case[5]
  for tiling in TILINGS:
    blocks = dataclasses.replace(HopperBlockSizes.default(case[4], causal),
                                 **{"overlap_softmax": False, **tiling})
    fn = lambda q, k, v, blocks=blocks: js.dot_product_attention(
        q, k, v, is_causal=causal, block_sizes=blocks, implementation="mosaic_gpu")
    impl = f"q{blocks.block_q} kv{blocks.block_kv} s{blocks.num_stages}"
    impl += " persistent" * blocks.persistent + " one producer warp" * blocks.one_producer_warp
    impl += " overlap softmax" * blocks.overlap_softmax
    impl += " dynamic" * blocks.dynamic_schedule
    report.measure(mode="fwd", impl=impl, fn=fn,
                   arg_sets=[(q, k, v)], flops=flops, **common)
  # The peers' forwards in the same run, as the yardsticks (those whose wheels are
  # installed: benchmarks/run_gpu.sh installs them from .peers).
  impls = implementations(*case[2:6])
  for peer in PEERS:
    fn, absent = impls[peer]
    if fn is None:
      print(f"{peer}: {absent}")
      continue
    report.measure(mode="fwd", impl=peer, fn=fn, arg_sets=[(q, k, v)], flops=flops, **common)


if __name__ == "__main__":
  harness.run("tune_attention_hopper", __doc__, SHAPES, SMOKE_SHAPES, bench_shape,
              lambda case, dtype, modes: len(TILINGS) + len(PEERS), unit="TFLOP/s")
