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
regex:backward|bprop|bwd for ours, cuDNN's and FA3's);
--feature: one of bench_attention_features.py's features, its arrays and its calls
(e.g. "alibi": slopes 2^-(n+1), ours only; "bias heads": a (1, N, T, S) bfloat16
relative-position bias; "mask": a (B, 1, T, S) mask array; triton and cudnn read both in
their kernels); --schedule: the Hopper backward's schedule, as
bench_attention_backward.py's HOPPER_BWD_SCHEDULES names one (e.g. stale+fa3; a "det"
there is --impl deterministic here); --forward: the Hopper forward's tiles for
--impl mosaic_gpu, the head dim's default (`HopperBlockSizes.default` of a call of few
(batch row, head) pairs) with bench_attention.py's FORWARD_FLAGS set, +-joined (e.g.
"dynamic": claimed items where the call's own default would take the grid).
"""

from __future__ import annotations

import argparse
import os

import jax

from bench_attention import OURS, case_inputs, implementations
from bench_attention_backward import parse_schedule
from bench_attention_features import FEATURES, RUNS, attention_fn, feature_arrays
from jaxsoftmax.attention.mosaic_gpu import backward as mosaic_backward

# --impl names of our rows in `implementations`.
_OURS = {"mosaic_gpu": f"{OURS} mosaic_gpu", "triton": f"{OURS} triton",
         "deterministic": f"{OURS} mosaic_gpu deterministic"}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impl", default="mosaic_gpu")
  parser.add_argument("--shape", default="4,4096,16,16,128,0")
  parser.add_argument("--mode", default="fwd", choices=("fwd", "fwd+bwd"))
  parser.add_argument("--feature", choices=FEATURES[1:])
  parser.add_argument("--schedule", default="")
  parser.add_argument("--forward", default="")
  args = parser.parse_args()
  if args.forward:
    if args.impl != "mosaic_gpu" or args.feature:
      parser.error("--forward: for --impl mosaic_gpu without --feature")
    os.environ["HOPPER_FWD_SCHEDULES"] = args.forward
    args.impl = f"{OURS} mosaic_gpu {args.forward}"
  if args.schedule:
    mosaic_backward.BLOCKS, deterministic = parse_schedule(args.schedule)
    if deterministic:
      parser.error("--schedule: pass --impl deterministic rather than det")
  B, T, N, K, H, causal = (int(x) for x in args.shape.split(","))
  (q, k, v, do), _, _ = case_inputs((B, T, N, K, H, bool(causal)), jax.numpy.bfloat16)
  if args.feature:
    runs = [impl for impl, features in RUNS.items() if args.feature in features]
    impl = _OURS.get(args.impl, args.impl)
    if impl not in runs:
      parser.error(f"--feature {args.feature}: runs on {runs}, not {args.impl}")
    kw, _ = feature_arrays(args.feature, B, T, N)
    fn = attention_fn(impl, bool(causal), kw)
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
