"""What a mask or bias tile costs the Triton forward through its pipeline stages, in one
run: the plain forward at its default tiles and with one stage fewer (what
`tiling.forward_stages` gives a forward whose mask or bias tile would cost it programs
an SM), each feature at the default tiles (so with its stage cut), and the plain call
and each feature at 128 x 64 tiles on eight warps and three stages, where the tile
costs no stage (one program an SM, as many warps an SM as the default's two).

    PYTHONPATH=. python3 benchmarks/plane_tile_stages.py --out benchmarks/results/tuning

Offline (`resources_offline.sh --pipelining --mode fwd --forward-tiles 128,64,8,3`), a
program of the 128 x 64 forward takes 131072 bytes of shared memory plain, 147456 with
the mask tile and 163840 with a bfloat16 bias tile, all three stages kept; the default
64 x 64 forward takes 114688 plain and, cut to two stages, 86016 with the mask tile
(4,4096,16,16,128). The features are bench_attention_features.py's.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

import harness
import jaxsoftmax as js
from bench_attention import case_inputs
from bench_attention_features import feature_arrays
from jaxsoftmax.attention import BlockSizes, reference
from jaxsoftmax.attention.triton.tiling import Dims, forward_stages

SHAPES = [((4, 4096, 16, 16, 128, False), jnp.bfloat16),
          ((4, 4096, 16, 16, 128, True), jnp.bfloat16)]
SMOKE_SHAPES = [((2, 64, 2, 1, 32, True), jnp.bfloat16)]
FEATURES = ("mask", "bias heads")


def bench_shape(report: harness.Report, case, dtype):
  B, T, N, K, H, causal = case
  (q, k, v, _), common, flops = case_inputs(case, dtype)
  default = BlockSizes.default(T, T, H, dtype, causal)
  cut = dataclasses.replace(default, num_stages=max(2, default.num_stages - 1))
  wide = dataclasses.replace(default, block_q=128, block_k=64, num_warps=8, num_stages=3)
  # Errors against the float64 truth on batch row 0 and the query heads of K/V head 0,
  # as bench_attention_features.py takes them.
  group = N // K
  part_q = lambda a: a[:1, :, :group]
  arrays = {name: feature_arrays(name, B, T, N) for name in ("plain", *FEATURES)}
  truths = {}
  for name, (kw, part) in arrays.items():
    ref = lambda q, k, v, kw=part(kw, group): reference.dot_product_attention(
        q, k, v, is_causal=causal, **kw)[0]
    truths[name] = harness.float64_truth(ref, part_q(q), k[:1, :, :1], v[:1, :, :1])
  runs = [("plain", default), ("plain, a stage fewer", cut)]
  runs += [(feature, default) for feature in FEATURES]
  runs += [("plain", wide)] + [(feature, wide) for feature in FEATURES]
  for name, blocks in runs:
    kw = arrays[name.split(",")[0]][0]
    fn = lambda q, k, v, blocks=blocks, kw=kw: js.dot_product_attention(
        q, k, v, is_causal=causal, implementation="triton", block_sizes=blocks, **kw)
    # The stages the kernel runs: the features' planes here are full (T x S) tiles.
    plane = next(iter(kw.values()), None)
    run = forward_stages(blocks, Dims.of(q, k, v), q.dtype.itemsize,
                         0 if plane is None else
                         blocks.block_q * blocks.block_k * plane.dtype.itemsize)
    tiles = f"q{run.block_q} k{run.block_k} w{run.num_warps} s{run.num_stages}"
    report.measure(mode="fwd", impl=f"{name} ({tiles})", fn=fn, arg_sets=[(q, k, v)],
                   flops=flops, truth=truths[name.split(",")[0]], compare=part_q, **common)


if __name__ == "__main__":
  harness.run("plane_tile_stages", __doc__, SHAPES, SMOKE_SHAPES, bench_shape,
              lambda case, dtype, modes: 2 + 2 * len(FEATURES) + 1, unit="TFLOP/s",
              default_modes="fwd")
