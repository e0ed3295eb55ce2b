"""Where the time of one linear + cross-entropy training step goes, kernel by kernel.

    PYTHONPATH=.:benchmarks python3 benchmarks/profile_linear_cross_entropy.py --out DIR

`jax.value_and_grad` of the mean loss with respect to hidden and weight, at
bench_linear_cross_entropy.py's shapes (``--only`` picks them), for our default, for XLA's
`x @ w` + optax and, in bfloat16, for ours with `implementation="triton"` (the Triton
forward, ds from XLA's float32 logits; in float32 that is the default): a
`jax.profiler` trace of CALLS back-to-back steps, GPU 0's kernels grouped by name
(launches and microseconds per step, share of the step's kernel time), and XLA's memory
analysis of the compiled step. The fused step's time beyond
XLA's is the recomputed logits (a fourth T·H·V product; in float32 a fifth, for each
row's softmax state) and whatever the grouping shows
besides: the chunked backward's elementwise passes (the float32 dhidden accumulation,
and without the Hopper dlogits kernel ds from float32 logits) and its products' speed
against cuBLAS's best. Writes DIR/profile_linear_cross_entropy.md and prints it.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import harness
import jaxsoftmax as js
from bench_linear_cross_entropy import (IMPLS as BENCH_IMPLS, SHAPES, SMOKE_SHAPES, TRITON,
                                        shape_inputs)

CALLS = 3
IMPLS = {
    "jaxsoftmax fused": lambda x, w, y: js.linear_cross_entropy(x, w, y),
    "x @ w + optax": lambda x, w, y: optax.softmax_cross_entropy_with_integer_labels(
        x @ w, y).mean(),
}


def profile_shape(shape, dtype) -> list[str]:
  x, w, y = shape_inputs(shape, dtype)
  T, H, V = shape
  lines = []
  impls = dict(IMPLS)
  if dtype == jnp.bfloat16:  # where the default's ds comes from the Hopper dlogits kernel
    impls[TRITON] = BENCH_IMPLS[TRITON]
  for impl, fn in impls.items():
    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    memory = step.lower(x, w, y).compile().memory_analysis()
    peak = (memory.temp_size_in_bytes + memory.output_size_in_bytes) / 2**20
    groups = harness.kernel_groups(
        harness.device_kernels(harness.trace_planes(step, (x, w, y), CALLS)), CALLS)
    total = sum(us for _, _, us in groups)
    lines += [f"## {impl}, {T}x{H}x{V} {jnp.dtype(dtype).name}", "",
              f"Kernel time per step {total:.0f} us; temporaries + outputs {peak:.0f} MiB.",
              ""]
    lines += harness.kernel_table(groups, total, "step") + [""]
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  harness.add_shape_args(parser)
  args = parser.parse_args()
  shapes = harness.chosen_shapes(args, SHAPES, SMOKE_SHAPES)
  device = jax.devices()[0]
  lines = ["# profile_linear_cross_entropy", "",
           f"{getattr(device, 'device_kind', device.platform)}, JAX {jax.__version__}: "
           f"kernels of {CALLS} traced steps grouped by name, per step.", ""]
  for shape, dtype in shapes:
    lines += profile_shape(shape, dtype)
  harness.write_lines(args.out, "profile_linear_cross_entropy.md", lines)


if __name__ == "__main__":
  main()
