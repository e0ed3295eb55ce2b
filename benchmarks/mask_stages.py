"""What the mask array's forward pays for its stage cut: the plain Triton forward at its
default tiles, the same with one pipeline stage fewer (what `tiling.forward_stages` gives
a forward that reads a mask or bias tile), and the forward with bench_attention_features'
mask array; then both at 128 x 64 tiles on eight warps and two stages, which the mask
tile does not cut; in one run.

    PYTHONPATH=. python3 benchmarks/mask_stages.py --out benchmarks/results/tuning

If the plain kernel with the cut stage runs about as slow as the mask's, the stage is
the mask's cost (and a smaller mask tile, which keeps it, the remedy); if it runs as the
plain one does, the cost is in the tile's reads and compares.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

import harness
import jaxsoftmax as js
from bench_attention import case_inputs
from bench_attention_features import feature_arrays
from jaxsoftmax.attention import BlockSizes

SHAPES = [((4, 4096, 16, 16, 128, False), jnp.bfloat16),
          ((4, 4096, 16, 16, 128, True), jnp.bfloat16)]
SMOKE_SHAPES = [((2, 64, 2, 1, 32, True), jnp.bfloat16)]


def bench_shape(report: harness.Report, case, dtype):
  B, T, N, K, H, causal = case
  (q, k, v, _), common, flops = case_inputs(case, dtype)
  default = BlockSizes.default(T, T, H, dtype)
  cut = dataclasses.replace(default, num_stages=max(2, default.num_stages - 1))
  mask = feature_arrays("mask", B, T, N)[0]
  # A tiling with two stages to begin with, which the mask tile leaves whole.
  wide = dataclasses.replace(default, block_q=128, block_k=64, num_warps=8, num_stages=2)
  runs = [(f"plain s{default.num_stages}", default, {}),
          (f"plain s{cut.num_stages}", cut, {}),
          ("mask (its stages cut)", default, mask),
          ("plain s2", wide, {}),
          ("mask s2", wide, mask)]
  for name, blocks, kw in runs:
    fn = lambda q, k, v, blocks=blocks, kw=kw: js.dot_product_attention(
        q, k, v, is_causal=causal, implementation="triton", block_sizes=blocks, **kw)
    tiles = f"q{blocks.block_q} k{blocks.block_k} w{blocks.num_warps}"
    report.measure(mode="fwd", impl=f"{name} {tiles}", fn=fn, arg_sets=[(q, k, v)],
                   flops=flops, **common)


if __name__ == "__main__":
  harness.run("mask_stages", __doc__, SHAPES, SMOKE_SHAPES, bench_shape,
              lambda case, dtype, modes: 5, unit="TFLOP/s", default_modes="fwd")
