"""Sweeps the forward kernel's tiles of `linear_cross_entropy` on the GPU.

    PYTHONPATH=.:benchmarks python3 benchmarks/tune_linear_cross_entropy.py --out DIR

The Triton forward runs at 0.64x-0.65x the speed of cuBLAS's bfloat16 product alone on
the H200 (21.2 and 22.2 ms against 13.5 and 14.5 ms at the two bfloat16 shapes,
`benchmarks/results/tuning/tune_linear_cross_entropy_hopper*.md`) on its defaults, 64
rows x 128 columns x 64 hidden per product on 4 warps, 2 stages: tiles that Hopper's
tensor cores (one warpgroup's 64-row wgmma) fill only in part. So the sweep tries taller
and wider tiles, deeper hidden chunks, 8 warps and deeper pipelines, at
bench_linear_cross_entropy.py's shapes, the loss alone (the backward's default runs
XLA's products), beside `x @ w` (XLA's product alone: the matmul ceiling, without the
loss); then, in bfloat16, the tiles of the Hopper (Mosaic GPU) forward, the default on
Hopper GPUs: vocabulary columns per tile, pipeline stages and vocabulary ranges. Each
call names its backend (`implementation="triton"`, `"mosaic_gpu"`), and each row is one
tiling, named in the impl column.
"""

from __future__ import annotations

import jax.numpy as jnp

import harness
import jaxsoftmax as js
from bench_linear_cross_entropy import SHAPES, SMOKE_SHAPES, ref, shape_inputs

# (block_rows, block_vocab, block_hidden, num_warps, num_stages): the default first.
TILES = [(64, 128, 64, 4, 2), (64, 128, 64, 4, 3), (64, 256, 64, 4, 3),
         (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 2),
         (128, 256, 64, 8, 4), (64, 256, 128, 8, 2), (128, 64, 64, 4, 3)]
SMOKE_TILES = [(16, 16, 16, 4, 2), (32, 16, 16, 4, 2)]
# The Hopper forward's (block_vocab, num_stages, vocab_splits), its default first; on
# GPUs other than Hopper's the rows record why they did not run.
HOPPER_TILES = [(256, 3, None), (256, 4, None), (192, 3, None), (128, 3, None),
                (256, 3, 8), (256, 3, 64)]


def _name(t: js.LinearCrossEntropyTiling) -> str:
  return (f"{t.block_rows}x{t.block_vocab}x{t.block_hidden} w{t.num_warps} "
          f"s{t.num_stages}")


def _hopper_dtype(dtype) -> bool:
  """The Hopper kernel takes bfloat16 and float16 only: float32 shapes, the smoke run's
  among them, sweep the Triton forward alone."""
  return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _tiles(shape) -> list:
  """The Triton tiles to sweep: the smoke run's at a shape bench_linear_cross_entropy.py
  does not time."""
  return TILES if tuple(shape) in [s for s, _ in SHAPES] else SMOKE_TILES


def tune_shape(report: harness.Report, shape, dtype):
  T, H, V = shape
  x, w, y = shape_inputs(shape, dtype)
  common = dict(op="linear_cross_entropy", mode="fwd", shape=shape,
                dtype=jnp.dtype(dtype).name, flops=2 * T * H * V)
  truth = harness.float64_truth(ref, x, w, y)
  report.measure(impl="x @ w (product alone)", fn=lambda x, w, y: x @ w,
                 arg_sets=[(x, w, y)], **common)
  for tile in _tiles(shape):
    tiling = js.LinearCrossEntropyTiling(*tile[:3], num_warps=tile[3], num_stages=tile[4])
    fn = lambda x, w, y, tiling=tiling: js.linear_cross_entropy(
        x, w, y, implementation="triton", tiling=tiling)
    default = tiling == js.LinearCrossEntropyTiling()
    report.measure(impl=_name(tiling) + (" (default)" if default else ""), fn=fn,
                   arg_sets=[(x, w, y)], truth=truth, **common)
  if not _hopper_dtype(dtype):
    return
  for block_vocab, stages, splits in HOPPER_TILES:
    hopper = js.LinearCrossEntropyHopperTiling(block_vocab, stages, splits)
    tiling = js.LinearCrossEntropyTiling(hopper=hopper)
    fn = lambda x, w, y, tiling=tiling: js.linear_cross_entropy(
        x, w, y, implementation="mosaic_gpu", tiling=tiling)
    report.measure(impl=f"Hopper {block_vocab} s{stages} splits {splits or 'auto'}"
                   + (" (default)" if hopper == js.LinearCrossEntropyHopperTiling() else ""),
                   fn=fn, arg_sets=[(x, w, y)], truth=truth, **common)


if __name__ == "__main__":
  harness.run("tune_linear_cross_entropy", __doc__, SHAPES, SMOKE_SHAPES, tune_shape,
              lambda shape, dtype, modes: (1 + len(_tiles(shape))
                                           + len(HOPPER_TILES) * _hopper_dtype(dtype)),
              unit="TFLOP/s",
              flops_doc="2·T·H·V (the loss's product)")
