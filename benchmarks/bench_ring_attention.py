"""Context-parallel attention on several GPUs against our attention on one, same problem.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_ring_attention.py --out benchmarks/results
    ... --smoke   # tiny sizes on the CPU's virtual devices: causal forward + backward
                  # and full forward (the XLA path unless JAXSOFTMAX_INTERPRET=1 asks for
                  # the interpreted kernels)

bfloat16, B=1, N=16 (and GQA 32/8), H=128, T = 32k to 256k tokens in total, causal
(zigzag layout) and not (contiguous), forward and forward + backward, for the ring and
all-gather strategies on every visible GPU, beside `dot_product_attention` on one GPU;
with --lhs, the ring also with XLA's latency-hiding scheduler turned on for its program
(", LHS"; it changed nothing measurable on 2 GPUs,
benchmarks/results/tuning/ring_attention_lhs.md).

Times are end to end: wall clock per call over 10 calls issued back to back, the median
of three runs, with the inputs already placed (zigzag-ordered and sharded for the
context-parallel rows). The one-GPU baseline runs on GPU 0, and on the last GPU too, to
show how far the GPUs' speeds differ. A multi-device call has no single device time, so
instead a `jax.profiler` trace of device 0 splits one call: the time its compute kernels
keep the GPU busy (the union of their intervals), the time in NCCL kernels and how much
of it runs under compute kernels (the ring's overlap), and the exposed communication and
idle time (wall minus compute); every GPU's kernels of that call go to
``<name>_timelines/`` as JSON, to read where the idle time sits, beside the optimized HLO
(the schedule XLA chose). Error: the largest absolute difference of the output (or of
dq, dk and dv) from one GPU's. Speedup: one GPU's time over the context-parallel time;
TFLOP/s over 4·B·N·T²·H (halved when causal; 3.5x for forward + backward) and the wall
time.
"""

from __future__ import annotations

import os

# Eight virtual devices for --smoke on a CPU (ignored by GPUs); set before JAX starts.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import harness  # noqa: E402
import jaxsoftmax as js  # noqa: E402

CALLS = 10
# (T, N, K): tokens in total, query and key/value heads; H = 128, B = 1.
# The last three: the 4- and 8-GPU runs' 256k tokens and GQA at 128k and 256k (at 8
# GPUs, 131072 tokens are 16k a GPU).
SHAPES = [(32768, 16, 16), (65536, 16, 16), (131072, 16, 16), (65536, 32, 8),
          (262144, 16, 16), (131072, 32, 8), (262144, 32, 8)]
SMOKE_SHAPES = [(128, 4, 2)]
H, SMOKE_H = 128, 16


def wall_us(fn, args, smoke: bool = False) -> float:
  """Median over three runs of the wall time per call of CALLS back-to-back calls; one
  call for a --smoke run, which checks the script and the results, not the speed (its
  interpreted kernels take seconds a call)."""
  jax.block_until_ready(fn(*args))
  calls, repeats = (1, 1) if smoke else (CALLS, 3)
  runs = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(calls)])
    runs.append((time.perf_counter() - start) * 1e6 / calls)
  return statistics.median(runs)


# XLA's latency-hiding scheduler, per compiled program (--lhs). Tried for the ring's
# overlap: the transfer that ran under no kernel was the second of two collective permutes
# (K's beside V's), synchronous with the scheduler or without
# (benchmarks/results/tuning/ring_attention_switchfree.md, its ", LHS" rows, and the
# timeline beside it); one stacked buffer fixed it.
_LATENCY_HIDING = {"xla_gpu_enable_latency_hiding_scheduler": True}


def _union(intervals) -> float:
  total, end = 0.0, float("-inf")
  for start, stop in sorted(intervals):
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total


def _overlap(intervals, others) -> float:
  """Time of ``intervals`` that some interval of ``others`` covers too."""
  total = 0.0
  for start, stop in intervals:
    total += _union([(max(start, a), min(stop, b)) for a, b in others
                     if a < stop and b > start])
  return total


def device0_split(fn, args, timeline_path=None) -> dict:
  """Compute-busy time, NCCL time and the part of it that overlaps compute (us) of one
  call on GPU 0, from a jax.profiler trace: the ring's transfers should hide behind the
  kernels. ``timeline_path``: also write every GPU's kernels there as JSON (stream,
  kernel, start and duration in us from the call's first kernel), to read where the
  idle time sits."""
  # GPU plane -> [(stream, kernel, start us, end us)]
  kernels = {plane: [(line, name, start, start + duration)
                     for line, events in lines.items() if line.startswith("Stream")
                     for name, start, duration in events]
             for plane, lines in harness.trace_planes(fn, args).items()
             if plane.startswith("/device:GPU:")}
  compute, nccl = [], []
  for _, name, start, stop in kernels["/device:GPU:0"]:
    (nccl if "nccl" in name.lower() else compute).append((start, stop))
  if timeline_path is not None:
    t0 = min(start for events in kernels.values() for _, _, start, _ in events)
    with open(timeline_path, "w") as f:
      json.dump({plane: [(stream, name[:120], round(start - t0, 1), round(stop - start, 1))
                         for stream, name, start, stop in sorted(events, key=lambda e: e[2])]
                 for plane, events in kernels.items()}, f)
  return dict(compute_us=_union(compute), nccl_us=sum(b - a for a, b in nccl),
              nccl_hidden_us=_overlap(nccl, compute))


def bench(T: int, N: int, K: int, head_dim: int, causal: bool, mode: str, dtype, smoke,
          timeline_dir=None, lhs=False):
  """The rows of one case; ``timeline_dir``: where to write each context-parallel row's
  kernel timeline (`device0_split`)."""
  devices = jax.devices()
  P = len(devices)
  mesh = jax.make_mesh((P,), ("sp",), devices=devices)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, do = (jax.random.normal(k, (1, T, N, head_dim), jnp.float32).astype(dtype)
           for k in keys[:2])
  k, v = (jax.random.normal(k, (1, T, K, head_dim), jnp.float32).astype(dtype)
          for k in keys[2:])
  flops = 4 * T * T * N * head_dim * (0.5 if causal else 1.0) * (3.5 if mode != "fwd" else 1)

  def timed(attention, compiler_options=None):
    if mode == "fwd":
      return jax.jit(attention, compiler_options=compiler_options)

    def forward_backward(q, k, v, do):
      out, vjp = jax.vjp(attention, q, k, v)
      return vjp(do)

    return jax.jit(forward_backward, compiler_options=compiler_options)

  single = timed(functools.partial(js.dot_product_attention, is_causal=causal))
  inputs = (q, k, v) if mode == "fwd" else (q, k, v, do)
  rows = []
  base = wall_us(single, inputs, smoke)
  # The error column: the context-parallel results (the output, or dq, dk and dv) against
  # one GPU's, in natural order on the host.
  expected = [np.asarray(x, np.float32) for x in jax.tree.leaves(single(*inputs))]
  common = dict(T=T, N=N, K=K, H=head_dim, causal=causal, mode=mode, devices=P)
  rows.append(dict(common, impl="1 device", wall_us=base, speedup=1.0,
                   tflops=flops / base / 1e6))
  if P > 1 and not smoke:  # the same on the last GPU: how far the GPUs' speeds differ
    other = wall_us(single, [jax.device_put(x, devices[-1]) for x in inputs])
    rows.append(dict(common, impl=f"1 device, GPU {P - 1}", wall_us=other,
                     speedup=base / other, tflops=flops / other / 1e6))
  layout = "zigzag" if causal else "contiguous"
  tokens = PartitionSpec(None, "sp")
  placed = [jax.device_put(js.zigzag_permute(x, P) if causal else x,
                           NamedSharding(mesh, tokens)) for x in inputs]
  variants = [("ring", None), *([("ring", _LATENCY_HIDING)] if lhs else []),
              ("all_gather", None)]
  for strategy, compiler_options in variants:
    attention = jax.shard_map(
        functools.partial(js.ring_attention, axis_name="sp", is_causal=causal,
                          layout=layout, strategy=strategy),
        mesh=mesh, in_specs=(tokens,) * 3, out_specs=tokens, check_vma=False)
    fn = timed(attention, compiler_options).lower(*placed).compile()
    t = wall_us(fn, placed, smoke)
    impl = f"{P} devices {strategy} {layout}" + (", LHS" if compiler_options else "")
    got = [np.asarray(js.zigzag_unpermute(x, P) if causal else x, np.float32)
           for x in jax.tree.leaves(fn(*placed))]
    row = dict(common, impl=impl, wall_us=t, speedup=base / t, tflops=flops / t / 1e6,
               max_abs_diff=max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected)))
    if not smoke:
      timeline = None
      if timeline_dir is not None:
        timeline = os.path.join(timeline_dir, f"T{T}_N{N}_K{K}_{'causal' if causal else 'full'}"
                                f"_{mode}_{strategy}{'_lhs' if compiler_options else ''}.json")
      split = device0_split(fn, placed, timeline)
      if timeline is not None:  # the schedule XLA chose, to read beside the timeline
        with open(timeline.replace(".json", ".hlo.txt"), "w") as f:
          f.write(fn.as_text())
      row.update(split, exposed_us=t - split["compute_us"])
    rows.append(row)
  return rows


def markdown(rows, meta) -> str:
  lines = [
      "# ring_attention", "",
      f"{meta['devices']} x {meta['device']}, JAX {meta['jax']}, {meta['date']}. "
      "Wall time per call (us, median of 3 runs of 10 back-to-back calls, inputs placed); "
      "speedup over our attention on one device for the same problem; on device 0 of "
      "one traced call: compute busy (union of its compute kernels), NCCL kernel time, "
      "the NCCL time during which compute kernels run too (the overlap), and wall minus "
      "compute busy (exposed communication and idle); the largest absolute difference "
      "of the output (fwd) or of dq, dk and dv (fwd+bwd) from one device's.", "",
      "| T | N/K | causal | mode | impl | wall us | TFLOP/s | speedup | compute us | "
      "NCCL us | NCCL under compute us | wall - compute us | max abs diff from 1 device |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  fmt = lambda r, key, f=".0f": "" if r.get(key) is None else format(r[key], f)
  for r in rows:
    lines.append(
        f"| {r['T']} | {r['N']}/{r['K']} | {'yes' if r['causal'] else 'no'} | {r['mode']} | "
        f"{r['impl']} {r.get('note', '')} | {fmt(r, 'wall_us')} | {fmt(r, 'tflops')} | "
        f"{fmt(r, 'speedup', '.2f')} | {fmt(r, 'compute_us')} | {fmt(r, 'nccl_us')} | "
        f"{fmt(r, 'nccl_hidden_us')} | {fmt(r, 'exposed_us')} | "
        f"{fmt(r, 'max_abs_diff', '.1e')} |")
  return "\n".join(lines) + "\n"


def plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cases = list(dict.fromkeys((r["T"], r["N"], r["K"], r["causal"], r["mode"]) for r in rows))
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  fig, ax = plt.subplots(figsize=(12, 4))
  width = 0.8 / len(impls)
  for i, impl in enumerate(impls):
    speed = {(r["T"], r["N"], r["K"], r["causal"], r["mode"]): r["speedup"]
             for r in rows if r["impl"] == impl and "speedup" in r}
    ax.bar([c + i * width for c in range(len(cases))], [speed.get(c, 0) for c in cases],
           width, label=impl)
  labels = [f"T{T} {N}/{K}\n{'causal' if c else 'full'} {m}" for T, N, K, c, m in cases]
  ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], labels, fontsize=7)
  ax.set_ylabel("speedup over one device")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, any backend")
  parser.add_argument("--only", default=None, help="comma-separated indices of SHAPES")
  parser.add_argument("--name", default="ring_attention")
  parser.add_argument("--lhs", action="store_true",
                      help="also the ring under XLA's latency-hiding scheduler")
  args = parser.parse_args()
  if jax.default_backend() != "gpu" and not args.smoke:
    raise SystemExit("benchmarks time compiled kernels: run them on GPUs (or --smoke)")
  shapes, head_dim = (SMOKE_SHAPES, SMOKE_H) if args.smoke else (SHAPES, H)
  if args.only is not None:
    shapes = [shapes[int(i)] for i in args.only.split(",")]
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  meta = dict(device=jax.devices()[0].device_kind, devices=len(jax.devices()),
              jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, args.name)
  timelines = path + "_timelines"  # each context-parallel row's kernels, per GPU
  os.makedirs(timelines, exist_ok=True)
  rows = []
  # A --smoke run checks the script and its results, not the speed: two cases, both
  # layouts and both modes.
  cases = ([(True, "fwd+bwd"), (False, "fwd")] if args.smoke else
           [(causal, mode) for causal in (True, False) for mode in ("fwd", "fwd+bwd")])
  for T, N, K in shapes:
    for causal, mode in cases:
      try:
        new = bench(T, N, K, head_dim, causal, mode, dtype, args.smoke, timelines,
                    args.lhs)
      except Exception as e:  # noqa: BLE001 - a failed case is a row that says why
        new = [dict(T=T, N=N, K=K, H=head_dim, causal=causal, mode=mode,
                    devices=meta["devices"], impl="not measured",
                    note=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")]
      for r in new:
        speed = (f"{r['wall_us']:10.0f} us {r['tflops']:6.0f} TFLOP/s {r['speedup']:.2f}x"
                 if "wall_us" in r else r["note"])
        print(f"T={T:6d} N={N}/{K} causal={causal!s:5} {mode:7s} {r['impl']:28s} {speed}",
              flush=True)
      rows += new
      with open(path + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
      with open(path + ".md", "w") as f:
        f.write(markdown(rows, meta))
  plot(rows, path + ".png")
  print(f"wrote {path}.json/.md/.png")


if __name__ == "__main__":
  main()
