"""One decode_attention call (or cuDNN's on the same cache) for Nsight Compute to read
the counters of: compiles, runs twice (ncu then profiles the second launch, `--launch-skip
1 --launch-count 1`), and exits. Stage `decode-ncu` of run_gpu.sh runs it.

    ncu --clock-control none -k regex:decode_attention --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        python3 benchmarks/profile_decode.py --impl mosaic_gpu --shape 64,4096,32,8,128,1

--impl: a decode_attention implementation (mosaic_gpu, triton) or cudnn; --shape:
B,S,N,K,H,T (bfloat16, every sequence full, as bench_decode_attention.py's cases);
--page-size P: a paged cache of that page size (ours only); --tiles BLOCKxSTAGESpPROGRAMS
(triton only, as bench_decode_attention.py's DECODE_TRITON_VARIANTS): those
`triton.DecodeBlocks` instead of the ones `DecodeBlocks.choose` picks.
"""

from __future__ import annotations

import argparse

import jax

import jaxsoftmax as js
from bench_decode_attention import case_inputs, paged_cache, parse_triton_tiles
from jaxsoftmax._core import pallas
from jaxsoftmax.attention.decode import triton
from jaxsoftmax.attention.decode.api import run_kernels


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impl", default="mosaic_gpu", choices=("mosaic_gpu", "triton", "cudnn"))
  parser.add_argument("--shape", default="64,4096,32,8,128,1")
  parser.add_argument("--page-size", type=int, default=0)
  parser.add_argument("--tiles", default="")
  args = parser.parse_args()
  if args.tiles and args.impl != "triton":
    parser.error("--tiles: the Triton kernel's tiles")
  B, S, N, K, H, T = (int(x) for x in args.shape.split(","))
  q, k, v, lengths = case_inputs((B, S, N, K, H, T, None), jax.numpy.bfloat16)
  table = None
  if args.page_size:
    if args.impl == "cudnn":
      parser.error("--page-size: cuDNN takes no paged cache through jax.nn")
    (k, table), (v, _) = paged_cache(k, args.page_size, 0), paged_cache(v, args.page_size, 0)
  if args.impl == "cudnn":
    step = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=n, implementation="cudnn"))
  elif args.tiles:
    def step(q, k, v, n):
      dims = triton.DecodeDims.of(q, k, table, None, cores=pallas.num_cores(),
                                  tiles=parse_triton_tiles(args.tiles))
      return run_kernels(q, k, v, n, table, dims, scale=q.shape[-1] ** -0.5,
                         out_dtype=q.dtype, interpret=pallas.resolve_interpret(None))[0]
    step = jax.jit(step)
  else:
    step = jax.jit(lambda q, k, v, n: js.decode_attention(
        q, k, v, n, block_table=table, implementation=args.impl))
  for _ in range(2):
    jax.block_until_ready(step(q, k, v, lengths))


if __name__ == "__main__":
  main()
