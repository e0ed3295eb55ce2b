"""Where the time between back-to-back context-parallel calls goes: wall time per call
against the GPUs' busy time, with a `jax.profiler` trace of several calls in a row.

    PYTHONPATH=.:benchmarks python3 benchmarks/profile_ring_attention.py --out DIR
    ... --smoke   # tiny sizes on the CPU's virtual devices, one call timed and two
                  # traced (the XLA path unless JAXSOFTMAX_INTERPRET=1 asks for the
                  # interpreted kernels)

The causal zigzag ring forward on every visible GPU (bf16, B=1, N=16, H=128, --tokens
in total) and our attention on one GPU, each called through `jax.jit` and through its
ahead-of-time `Compiled` object (which `bench_ring_attention.py` times), 10 calls back
to back. Then the same 10 calls under the profiler: every device's kernels and every
host thread's events go to ``DIR/ring_profile_<name>.json`` (plane -> line -> [name,
start us, duration us]); GPU 0's span per call and its largest idle gaps are printed
beside the wall times: with the host ahead of the GPUs the span per call is the wall
time and the gaps are a few microseconds.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import jaxsoftmax as js  # noqa: E402
import harness  # noqa: E402
from bench_ring_attention import wall_us  # noqa: E402

CALLS_TRACED = 10  # as many as bench_ring_attention.wall_us times back to back


def trace(fn, args, path, calls: int = CALLS_TRACED) -> tuple[float, list[float]]:
  """Writes the trace of ``calls`` back-to-back calls to ``path``; returns GPU 0's span
  per call (first kernel's start to last kernel's end, over the calls) and its largest
  idle gaps (us), which would sit between the calls."""
  planes = harness.trace_planes(fn, args, calls)
  t0 = min(start for lines in planes.values() for events in lines.values()
           for _, start, _ in events)
  planes = {p: {line: [(n[:120], round(s - t0, 1), round(d, 1)) for n, s, d in events]
                for line, events in lines.items()} for p, lines in planes.items()}
  with open(path, "w") as f:
    json.dump(planes, f)
  span, gaps = harness.span_and_gaps(harness.device_kernels(planes), calls)
  return span, gaps[:3]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--tokens", type=int, default=65536)
  parser.add_argument("--smoke", action="store_true")
  args = parser.parse_args()
  if jax.default_backend() != "gpu" and not args.smoke:
    raise SystemExit("run it on GPUs (or --smoke)")
  T, N, H, dtype = ((args.tokens, 16, 128, jnp.bfloat16) if not args.smoke
                    else (128, 2, 16, jnp.float32))
  devices = jax.devices()
  P = len(devices)
  mesh = jax.make_mesh((P,), ("sp",), devices=devices)
  tokens = PartitionSpec(None, "sp")
  q, k, v = (jax.random.normal(key, (1, T, N, H), jnp.float32).astype(dtype)
             for key in jax.random.split(jax.random.PRNGKey(0), 3))
  placed = [jax.device_put(js.zigzag_permute(x, P), NamedSharding(mesh, tokens))
            for x in (q, k, v)]
  ring = jax.shard_map(
      functools.partial(js.ring_attention, axis_name="sp", is_causal=True, layout="zigzag"),
      mesh=mesh, in_specs=(tokens,) * 3, out_specs=tokens, check_vma=False)
  single = functools.partial(js.dot_product_attention, is_causal=True)
  os.makedirs(args.out, exist_ok=True)
  for name, f, inputs in (("1_device", single, (q, k, v)), (f"{P}_devices", ring, placed)):
    jitted = jax.jit(f)
    compiled = jitted.lower(*inputs).compile()
    # A --smoke run checks the script, not the speed: one call timed, two traced (a gap
    # between them).
    walls = {how: wall_us(fn, inputs, args.smoke)
             for how, fn in (("jit", jitted), ("compiled", compiled))}
    span, gaps = trace(jitted, inputs, os.path.join(args.out, f"ring_profile_{name}.json"),
                       2 if args.smoke else CALLS_TRACED)
    print(f"T={T} causal fwd {name:10s} wall us: jit {walls['jit']:9.0f} compiled "
          f"{walls['compiled']:9.0f}; traced, GPU 0's span per call {span:9.0f}, largest "
          f"idle gaps {', '.join(f'{g:.0f}' for g in gaps)}", flush=True)


if __name__ == "__main__":
  main()
