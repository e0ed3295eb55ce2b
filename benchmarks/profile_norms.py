"""One layer_norm / rms_norm call (forward, or forward + backward) for Nsight Compute to
read the counters of: compiles, runs twice (ncu then profiles the second launch of the
kernels it selects, `--launch-skip 1 --launch-count 1`), and exits.

    ncu --clock-control none -k regex:norm_bwd --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/profile_norms.py --op layer_norm --shape 65536,1024 --mode fwd+bwd

--op: layer_norm or rms_norm; --shape: rows,C; --dtype: float32 or bfloat16;
--param-dtype: scale's and bias' (default: x's; float32 beside bfloat16 x is Flax's
mixed precision); --residual: fuse the residual add; --mode: fwd or fwd+bwd (the
backward's kernels carry "_bwd" in their names).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxsoftmax as js


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--op", default="layer_norm", choices=("layer_norm", "rms_norm"))
  parser.add_argument("--shape", default="65536,1024")
  parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
  parser.add_argument("--param-dtype", default=None, choices=("float32", "bfloat16"))
  parser.add_argument("--residual", action="store_true")
  parser.add_argument("--mode", default="fwd+bwd", choices=("fwd", "fwd+bwd"))
  args = parser.parse_args()
  rows, C = (int(n) for n in args.shape.split(","))
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  x, r, dy, dh = (jax.random.normal(k, (rows, C), jnp.float32).astype(args.dtype)
                  for k in keys)
  param_dtype = args.param_dtype or args.dtype
  scale = jnp.ones((C,), param_dtype)
  bias = None if args.op == "rms_norm" else jnp.zeros((C,), param_dtype)
  residual = r if args.residual else None

  def norm(x, scale, bias, residual):
    if args.op == "rms_norm":
      return js.rms_norm(x, scale, residual=residual)
    return js.layer_norm(x, scale, bias, residual=residual)

  if args.mode == "fwd":
    step = jax.jit(norm)
  else:
    cotangent = (dy, dh) if args.residual else dy
    step = jax.jit(lambda *a: jax.vjp(norm, *a)[1](cotangent))
  for _ in range(2):
    jax.block_until_ready(step(x, scale, bias, residual))


if __name__ == "__main__":
  main()
