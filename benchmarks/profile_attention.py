"""One attention forward (or forward + backward) for Nsight Compute to read the counters
of: compiles, runs twice (ncu then profiles the second launch, `--launch-skip 1
--launch-count 1`), and exits.

    ncu --clock-control none -k regex:attention --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/profile_attention.py --impl mosaic_gpu --shape 4,4096,16,16,128,0

--impl: a jaxsoftmax backend (mosaic_gpu, triton; deterministic: mosaic_gpu with
deterministic=True) or a peer of bench_attention.py (cudnn, fa3, "tokamax mosaic": FA3
and tokamax from the peer wheels); --shape: B,T,N,K,H,causal; --mode fwd+bwd: the
forward and the backward (pick the backward's kernels with ncu's -k, e.g.
regex:backward|bprop|bwd for ours, cuDNN's and FA3's); --alibi: ALiBi slopes 2^-(n+1),
as bench_attention_features.py's (ours only); --bias heads: a (1, N, T, S) bfloat16
bias, bench_attention_features.py's relative-position one (triton and cudnn, which
read it in their kernels); --schedule: the Hopper backward's schedule, as
bench_attention_backward.py's HOPPER_BWD_SCHEDULES names one (e.g. stale+fa3; a "det"
there is --impl deterministic here).
"""

from __future__ import annotations

import argparse
import functools

import jax

import jaxsoftmax as js
from bench_attention import OURS, case_inputs, implementations
from bench_attention_backward import parse_schedule
from jaxsoftmax.attention.mosaic_gpu import backward as mosaic_backward

# --impl names of our rows in `implementations`.
_OURS = {"mosaic_gpu": f"{OURS} mosaic_gpu", "triton": f"{OURS} triton",
         "deterministic": f"{OURS} mosaic_gpu deterministic"}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impl", default="mosaic_gpu")
  parser.add_argument("--shape", default="4,4096,16,16,128,0")
  parser.add_argument("--mode", default="fwd", choices=("fwd", "fwd+bwd"))
  parser.add_argument("--alibi", action="store_true")
  parser.add_argument("--bias", choices=("heads",))
  parser.add_argument("--schedule", default="")
  args = parser.parse_args()
  if args.schedule:
    mosaic_backward.BLOCKS, deterministic = parse_schedule(args.schedule)
    if deterministic:
      parser.error("--schedule: pass --impl deterministic rather than det")
  B, T, N, K, H, causal = (int(x) for x in args.shape.split(","))
  (q, k, v, do), _, _ = case_inputs((B, T, N, K, H, bool(causal)), jax.numpy.bfloat16)
  if args.alibi and args.bias:
    parser.error("--alibi and --bias: one feature at a time")
  if args.alibi:
    if args.impl not in ("mosaic_gpu", "triton"):
      parser.error(f"--alibi: ours only (mosaic_gpu, triton), not {args.impl}")
    slopes = 2.0 ** -(jax.numpy.arange(N) + 1.0)
    fn = functools.partial(js.dot_product_attention, implementation=args.impl,
                           alibi_slopes=slopes, is_causal=bool(causal))
  elif args.bias:
    attention = {"triton": js.dot_product_attention, "cudnn": jax.nn.dot_product_attention}
    if args.impl not in attention:
      parser.error(f"--bias: triton or cudnn (the kernels that read a bias), not {args.impl}")
    bias = jax.random.normal(jax.random.key(1), (1, N, T, T), jax.numpy.bfloat16)
    fn = functools.partial(attention[args.impl], bias=bias, implementation=args.impl,
                           is_causal=bool(causal))
  else:
    fn, why = implementations(N, K, H, bool(causal)).get(_OURS.get(args.impl, args.impl),
                                                         (None, "no such implementation"))
    if fn is None:
      parser.error(f"--impl {args.impl}: {why}")
  if args.mode == "fwd":
    step, inputs = jax.jit(fn), (q, k, v)
  else:
    step, inputs = jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do)), (q, k, v, do)
  for _ in range(2):
    jax.block_until_ready(step(*inputs))


if __name__ == "__main__":
  main()
