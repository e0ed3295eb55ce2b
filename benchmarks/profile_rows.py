"""Where a row op's call spends its time on the device, kernel by kernel, ours beside XLA.

    PYTHONPATH=.:benchmarks python3 benchmarks/profile_rows.py --out DIR [--only 7]

For bench_softmax.py's shapes (``--only`` picks them) and the ops of ``--ops``
(softmax, log_softmax, logsumexp): the forward and, but for logsumexp, the forward +
backward (`jax.vjp` then the vjp, as the benchmark times them), for jaxsoftmax and for
`jax.nn`. A `jax.profiler` trace of CALLS back-to-back calls gives GPU 0's span per call
(first kernel's start to last kernel's end, over the calls), the sum of its kernels'
durations, its largest idle gaps, and the kernels grouped by name (launches and
microseconds per call). The span less the kernels is what launches and the gaps between
them cost: where a multi-kernel path (the split variant, XLA's merge of its partial
statistics) loses to XLA end to end. Writes DIR/profile_rows.md and prints it.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import harness
import jaxsoftmax as js
from bench_softmax import SHAPES, SMOKE_SHAPES

CALLS = 10
IMPLS = {"jaxsoftmax": js, "xla (jax.nn)": jax.nn}


def _call(fn, mode: str):
  if mode == "fwd":
    return lambda x, dy: fn(x, axis=-1)

  def forward_backward(x, dy):
    y, vjp = jax.vjp(lambda x: fn(x, axis=-1), x)
    return y, vjp(dy)[0]
  return forward_backward


def profile(op: str, mode: str, shape, dtype) -> list[str]:
  kx, kdy = jax.random.split(jax.random.PRNGKey(0))
  x = (4 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
  dy = jax.random.normal(kdy, shape, jnp.float32).astype(dtype)
  lines = []
  for impl, module in IMPLS.items():
    step = jax.jit(_call(getattr(module, op), mode))
    kernels = harness.device_kernels(harness.trace_planes(step, (x, dy), CALLS))
    span, gaps = harness.span_and_gaps(kernels, CALLS)
    groups = harness.kernel_groups(kernels, CALLS)
    busy = sum(us for _, _, us in groups)
    lines += [f"## {op} {mode}, {impl}, {'x'.join(map(str, shape))} "
              f"{jnp.dtype(dtype).name}", "",
              f"Span per call {span:.1f} us, kernels {busy:.1f} us; largest gaps (us): "
              + ", ".join(f"{g:.1f}" for g in gaps[:4]), ""]
    lines += harness.kernel_table(groups, busy, "call") + [""]
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  harness.add_shape_args(parser)
  parser.add_argument("--ops", default="softmax", help="comma-separated row ops")
  args = parser.parse_args()
  shapes = harness.chosen_shapes(args, SHAPES, SMOKE_SHAPES)
  device = jax.devices()[0]
  lines = ["# profile_rows", "",
           f"{getattr(device, 'device_kind', device.platform)}, JAX {jax.__version__}: "
           f"kernels of {CALLS} traced calls, per call.", ""]
  for shape, dtype in shapes:
    for op in args.ops.split(","):
      for mode in ("fwd",) if op == "logsumexp" else ("fwd", "fwd+bwd"):
        lines += profile(op, mode, shape, dtype)
  harness.write_lines(args.out, "profile_rows.md", lines)


if __name__ == "__main__":
  main()
