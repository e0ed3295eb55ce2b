"""Where an attention call spends its time on the device, kernel by kernel, ours beside
the peers: the attention kernels and everything around them (delta = rowsum(dO ∘ O), the
zeroed float32 dQ and its conversion, padding, layout changes).

    PYTHONPATH=.:benchmarks python3 benchmarks/profile_attention_kernels.py --out DIR
        [--only 1,6] [--modes fwd,fwd+bwd] [--impls "jaxsoftmax mosaic_gpu,fa3"]

``--only`` picks bench_attention.py's shapes (its SHAPES, by index, as ATTN_ONLY does),
``--impls`` its implementations (default: ours, our deterministic mode, cuDNN,
FlashAttention-3 and tokamax where their wheels are installed); ``--modes``: the forward
alone and the forward + backward as a training step runs them (`bench_attention.fwd_bwd`).
A `jax.profiler` trace of CALLS back-to-back calls gives GPU 0's span per call, the sum
of its kernels' durations, its largest idle gaps, and the kernels grouped by name
(launches and microseconds per call): where two implementations whose attention
kernels run level part is in the kernels around them. Writes DIR/NAME.md (--name,
default profile_attention_kernels) and prints it.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

import harness
from bench_attention import OURS, SHAPES, SMOKE_SHAPES, case_inputs, dims, fwd_bwd, implementations

CALLS = 10
IMPLS = (f"{OURS} mosaic_gpu", f"{OURS} mosaic_gpu deterministic", "cudnn", "fa3",
         "tokamax mosaic")


def profile(case, dtype, impls, modes) -> list[str]:
  """The sections of one shape: per implementation and mode, the span, the kernels' sum
  and gaps, and the kernels grouped by name."""
  (q, k, v, do), common, _ = case_inputs(case, dtype)
  B, T, N, K, H, causal, _ = dims(case)
  available = implementations(N, K, H, causal)
  shape = "x".join(map(str, common["shape"]))
  lines = []
  for impl in impls:
    fn, why = available.get(impl, (None, "no such implementation"))
    for mode in modes:
      title = f"## {common['op']} {mode}, {impl}, {shape} {common['dtype']}"
      if fn is None:
        lines += [title, "", f"Not measured: {why}", ""]
        continue
      step, args = ((jax.jit(fn), (q, k, v)) if mode == "fwd"
                    else (jax.jit(fwd_bwd(fn)), (q, k, v, do)))
      try:
        kernels = harness.device_kernels(harness.trace_planes(step, args, CALLS))
      except Exception as error:  # noqa: BLE001 - a peer that fails is a row that says so
        lines += [title, "", f"Not measured: {harness.failure_note(error)}", ""]
        continue
      lines += harness.kernel_section(title, kernels, CALLS)
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  harness.add_shape_args(parser)
  parser.add_argument("--name", default="profile_attention_kernels")
  parser.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
  parser.add_argument("--impls", default=",".join(IMPLS),
                      help="comma-separated implementations of bench_attention.py")
  args = parser.parse_args()
  modes = args.modes.split(",")
  if not set(modes) <= {"fwd", "fwd+bwd"}:
    parser.error(f"--modes {args.modes}: fwd, fwd+bwd")
  if jax.default_backend() != "gpu":
    if not args.smoke:
      parser.error("kernel times need a GPU (or pass --smoke)")
    os.environ.setdefault("JAXSOFTMAX_INTERPRET", "1")  # the kernels, interpreted
  device = jax.devices()[0]
  lines = [f"# {args.name}", "",
           f"{getattr(device, 'device_kind', device.platform)}, JAX {jax.__version__}: "
           f"kernels of {CALLS} traced calls, per call.", ""]
  for case, dtype in harness.chosen_shapes(args, SHAPES, SMOKE_SHAPES):
    lines += profile(case, jnp.dtype(dtype), args.impls.split(","), modes)
  harness.write_lines(args.out, f"{args.name}.md", lines)


if __name__ == "__main__":
  main()
