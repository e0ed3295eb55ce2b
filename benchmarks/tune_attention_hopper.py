"""Sweeps the Hopper (Mosaic GPU) forward's HopperBlockSizes on the GPU, to set
`HopperBlockSizes.default`.

    PYTHONPATH=. python3 benchmarks/tune_attention_hopper.py --out benchmarks/results

bfloat16, forward alone. The impl column names the tiles: "q64 kv128 s2" (block_q per
consumer warpgroup, block_kv, num_stages). Tilings that do not fit shared memory at a
head dim are rows that say so. Head dim 256 has one tiling that fits (64, 64, 2).
"""

from __future__ import annotations

import jax.numpy as jnp

import harness
import jaxsoftmax as js
from bench_attention import case_inputs
from jaxsoftmax.attention import HopperBlockSizes

SHAPES = [((4, 4096, 16, 16, 128, False), jnp.bfloat16),
          ((4, 4096, 16, 16, 128, True), jnp.bfloat16),
          ((1, 16384, 16, 16, 128, False), jnp.bfloat16),
          ((8, 2048, 16, 16, 64, False), jnp.bfloat16)]
SMOKE_SHAPES = [((1, 64, 2, 2, 64, True), jnp.bfloat16)]
TILINGS = [(64, 128, 2), (64, 128, 3), (64, 64, 2), (64, 64, 4), (64, 192, 2)]


def bench_shape(report: harness.Report, case, dtype):
  (q, k, v, _), common, flops = case_inputs(case, dtype)
  causal = case[5]
  for bq, bkv, stages in TILINGS:
    blocks = HopperBlockSizes(bq, bkv, stages)
    fn = lambda q, k, v, blocks=blocks: js.dot_product_attention(
        q, k, v, is_causal=causal, block_sizes=blocks, implementation="mosaic_gpu")
    report.measure(mode="fwd", impl=f"q{bq} kv{bkv} s{stages}", fn=fn,
                   arg_sets=[(q, k, v)], flops=flops, **common)


if __name__ == "__main__":
  harness.run("tune_attention_hopper", __doc__, SHAPES, SMOKE_SHAPES, bench_shape,
              lambda case, dtype: len(TILINGS), unit="TFLOP/s")
