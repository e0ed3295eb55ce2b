"""Sweeps the attention kernels' BlockSizes on the GPU, to set `BlockSizes.default`.

    PYTHONPATH=. python3 benchmarks/tune_attention.py --out benchmarks/results/tuning

bfloat16, head dims 64, 128 and 256. Forward tilings are timed on the forward alone;
backward tilings on forward + backward with the forward's default tiles, so the rows of
one shape differ only in the backward kernels. The impl column names the tiling:
forward "q128 k64 w8 s2" (block_q, block_k, num_warps, num_stages); backward
"dkv q64 k128 / dq q128 k64 w8 s2".
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

import harness
import jaxsoftmax as js
from bench_attention import fwd_bwd, case_inputs
from jaxsoftmax.attention import BlockSizes
from jaxsoftmax.attention.triton.tiling import LONG

SHAPES = [((4, 4096, 16, 16, 128, False), jnp.bfloat16),
          ((4, 4096, 16, 16, 128, True), jnp.bfloat16),
          ((8, 2048, 16, 16, 64, False), jnp.bfloat16),
          ((2, 8192, 16, 16, 256, False), jnp.bfloat16),
          ((1, 16384, 16, 16, 128, False), jnp.bfloat16),
          ((1, 16384, 16, 16, 128, True), jnp.bfloat16),
          ((1, 32768, 16, 16, 128, True), jnp.bfloat16)]
SMOKE_SHAPES = [((1, 64, 2, 2, 64, True), jnp.bfloat16)]

# (block_q, block_k, num_warps, num_stages)
FORWARD = {64: [(128, 64, 4, 2), (128, 128, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2),
                (64, 64, 4, 3), (128, 32, 4, 3)],
           128: [(128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3),
                 (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 2)],
           256: [(64, 64, 8, 2), (64, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2)]}
# (block_q_dkv, block_k_dkv, block_q_dq, block_k_dq, num_warps_bwd, num_stages_bwd)
BACKWARD = {64: [(64, 128, 128, 64, 4, 2), (32, 128, 128, 32, 4, 3),
                 (64, 64, 64, 64, 4, 2), (64, 128, 128, 64, 8, 2),
                 (32, 64, 64, 32, 4, 3), (128, 128, 128, 128, 8, 2)],
            128: [(64, 128, 128, 64, 8, 2), (32, 128, 128, 32, 8, 2),
                  (64, 64, 64, 64, 8, 2), (64, 128, 128, 64, 8, 3),
                  (32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 4, 2),
                  (32, 64, 64, 32, 4, 3), (128, 128, 128, 128, 8, 2),
                  (64, 128, 64, 128, 8, 2), (32, 128, 128, 64, 8, 2)],
            256: [(32, 64, 64, 32, 8, 2), (16, 64, 64, 16, 8, 2), (32, 32, 32, 32, 4, 2),
                  (64, 64, 64, 64, 8, 2), (64, 64, 64, 64, 16, 2), (32, 64, 64, 32, 16, 2),
                  (64, 32, 32, 64, 8, 2)]}


# Long sequences (T >= LONG): the head dim 128 forward tilings that lead at T = 4096,
# deeper pipelines of them, 256-row query tiles on 16 warps, and the backward's two best.
LONG_FORWARD = [(64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2),
                (128, 64, 8, 4), (64, 128, 4, 3), (64, 64, 4, 4), (128, 32, 4, 3),
                (128, 64, 4, 3), (256, 64, 16, 3), (256, 32, 16, 3)]
LONG_BACKWARD = [(64, 128, 128, 64, 8, 3), (32, 64, 64, 32, 4, 3)]


def tilings(case):
  """(forward tilings, backward tilings) swept for a case."""
  T, H = case[1], case[4]
  return (LONG_FORWARD, LONG_BACKWARD) if T >= LONG else (FORWARD[H], BACKWARD[H])


def bench_shape(report: harness.Report, case, dtype):
  B, T, N, K, H, causal = case
  (q, k, v, do), common, flops = case_inputs(case, dtype)
  default = BlockSizes.default(T, T, H, dtype)
  forward, backward = tilings(case)
  for bq, bk, warps, stages in forward:
    blocks = dataclasses.replace(default, block_q=bq, block_k=bk, num_warps=warps,
                                 num_stages=stages)
    fn = lambda q, k, v, blocks=blocks: js.dot_product_attention(
        q, k, v, is_causal=causal, block_sizes=blocks)
    report.measure(mode="fwd", impl=f"q{bq} k{bk} w{warps} s{stages}", fn=fn,
                   arg_sets=[(q, k, v)], flops=flops, **common)
  for dkv_q, dkv_k, dq_q, dq_k, warps, stages in backward:
    blocks = dataclasses.replace(default, block_q_dkv=dkv_q, block_k_dkv=dkv_k,
                                 block_q_dq=dq_q, block_k_dq=dq_k, num_warps_bwd=warps,
                                 num_stages_bwd=stages)
    fn = fwd_bwd(lambda q, k, v, blocks=blocks: js.dot_product_attention(
        q, k, v, is_causal=causal, block_sizes=blocks))
    report.measure(mode="fwd+bwd",
                   impl=f"dkv q{dkv_q} k{dkv_k} / dq q{dq_q} k{dq_k} w{warps} s{stages}",
                   fn=fn, arg_sets=[(q, k, v, do)], flops=3.5 * flops, **common)


if __name__ == "__main__":
  harness.run("tune_attention", __doc__, SHAPES, SMOKE_SHAPES, bench_shape,
              lambda case, dtype, modes: sum(map(len, tilings(case))),
              unit="TFLOP/s")
