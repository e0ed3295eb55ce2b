"""Where a row op's or a norm's call spends its time on the device, kernel by kernel,
ours beside XLA's.

    PYTHONPATH=.:benchmarks python3 benchmarks/profile_rows.py --out DIR [--only 7]
        [--ops softmax,log_softmax] [--modes fwd,fwd+bwd,bwd,step]

``--ops``: row ops (softmax, log_softmax, logsumexp: bench_softmax.py's shapes, ours and
`jax.nn`) or norms (layer_norm, rms_norm: bench_norms.py's shapes, ours, XLA's plain jnp
and Flax's modules), not both; ``--only`` picks the shapes. ``--modes``: the forward,
the forward + backward (`jax.vjp` then the pullback, as the benchmarks time them) and
the backward alone (`harness.pullbacks`); the norms also "step" (bench_norms.py: the
backward through y @ w); logsumexp has the forward only. A
`jax.profiler` trace of CALLS back-to-back calls gives GPU 0's span per call (first
kernel's start to last kernel's end, over the calls), the sum of its kernels' durations,
its largest idle gaps, and the kernels grouped by name (launches and microseconds per
call). The span less the kernels is what launches and the gaps between them cost: where
a multi-kernel path loses to XLA end to end. The kernels' names show where XLA fuses the
forward into the backward. Writes DIR/profile_rows.md and prints it.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

import bench_norms
import bench_softmax
import harness
import jaxsoftmax as js

CALLS = 10
ROW_OPS = ("softmax", "log_softmax", "logsumexp")
NORM_OPS = ("layer_norm", "rms_norm")


def _row_steps(op: str, mode: str, shape, dtype) -> dict:
  """impl -> (step, args) of a row op: x = 4·N(0, 1), dy = N(0, 1)."""
  kx, kdy = jax.random.split(jax.random.PRNGKey(0))
  x = (4 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
  dy = jax.random.normal(kdy, shape, jnp.float32).astype(dtype)
  steps = {}
  for impl, module in (("jaxsoftmax", js), ("xla (jax.nn)", jax.nn)):
    fn = bench_softmax._forward(getattr(module, op))
    if mode == "fwd":
      steps[impl] = (fn, (x,))
    elif mode == "fwd+bwd":
      steps[impl] = (bench_softmax._forward_backward(getattr(module, op)), (x, dy))
    else:
      call, (residuals,) = harness.pullbacks(fn, [(x,)])
      steps[impl] = (call, (residuals, dy))
  return steps


def _norm_steps(op: str, mode: str, shape, dtype) -> dict:
  """impl -> (step, args) of a norm without the residual: x, dy = N(0, 1)."""
  kx, kdy, ks, kb = jax.random.split(jax.random.PRNGKey(0), 4)
  x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
  dy = jax.random.normal(kdy, shape, jnp.float32).astype(dtype)
  scale = (1 + 0.1 * jax.random.normal(ks, shape[1:])).astype(dtype)
  bias = None if op == "rms_norm" else (0.1 * jax.random.normal(kb, shape[1:])).astype(dtype)
  rms = op == "rms_norm"
  steps = {}
  for impl, fn in (("jaxsoftmax", bench_norms._ours), ("xla", bench_norms._jnp_norm),
                   ("flax nnx", bench_norms._flax)):
    norm = bench_norms._differentiated(functools.partial(fn, rms=rms), False)
    if mode == "fwd":
      steps[impl] = (norm, (x, scale, bias))
    elif mode == "fwd+bwd":
      steps[impl] = (bench_norms._vjp(functools.partial(fn, rms=rms), False),
                     (x, scale, bias, None, dy, None))
    elif mode == "step":
      steps[impl] = (bench_norms._step(functools.partial(fn, rms=rms), False,
                                       bench_norms.step_weight(shape, dtype)),
                     (x, scale, bias, None, None))
    else:
      call, (residuals,) = harness.pullbacks(norm, [(x, scale, bias)])
      steps[impl] = (call, (residuals, dy))
  return steps


def profile(op: str, mode: str, shape, dtype) -> list[str]:
  steps = (_norm_steps if op in NORM_OPS else _row_steps)(op, mode, shape, dtype)
  lines = []
  for impl, (step, args) in steps.items():
    kernels = harness.device_kernels(harness.trace_planes(jax.jit(step), args, CALLS))
    lines += harness.kernel_section(
        f"## {op} {mode}, {impl}, {'x'.join(map(str, shape))} {jnp.dtype(dtype).name}",
        kernels, CALLS)
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  harness.add_shape_args(parser)
  parser.add_argument("--ops", default="softmax",
                      help="comma-separated row ops, or comma-separated norms")
  parser.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated modes")
  args = parser.parse_args()
  ops, modes = args.ops.split(","), args.modes.split(",")
  family = next((f for f in (ROW_OPS, NORM_OPS) if set(ops) <= set(f)), None)
  if family is None:
    parser.error(f"--ops {args.ops}: row ops {ROW_OPS} or norms {NORM_OPS}, not both")
  if not set(modes) <= {"fwd", "fwd+bwd", "bwd"} | ({"step"} if family is NORM_OPS else set()):
    parser.error(f"--modes {args.modes}: fwd, fwd+bwd, bwd (and step for the norms)")
  bench = bench_norms if family is NORM_OPS else bench_softmax
  shapes = harness.chosen_shapes(args, bench.SHAPES, bench.SMOKE_SHAPES)
  device = jax.devices()[0]
  lines = ["# profile_rows", "",
           f"{getattr(device, 'device_kind', device.platform)}, JAX {jax.__version__}: "
           f"kernels of {CALLS} traced calls, per call.", ""]
  for shape, dtype in shapes:
    for op in ops:
      for mode in [m for m in modes if m == "fwd" or op != "logsumexp"]:
        lines += profile(op, mode, shape, dtype)
  harness.write_lines(args.out, "profile_rows.md", lines)


if __name__ == "__main__":
  main()
