"""Writes benchmarks/results/README.md, today's numbers per op, from the JSON files there.

    python benchmarks/results_readme.py            # rewrites benchmarks/results/README.md
    python benchmarks/results_readme.py --check    # exits 1 if the README is out of date

Each op's JSON (written by its benchmark through `harness.Report`, or merged from several
runs by `merge_reports.py`) becomes one compact table: per shape and mode, our default
beside every peer, each with its device median / end-to-end (wall) time and its error,
and our speed-up over the fastest peer whose results are right. The op's .md holds the
full table. A report's meta may list the runs its rows come from (``runs``: date, file,
shapes, modes, command and a note, as the curated files here do), which the README lists under
the table; without it the report is one run, or a merge whose date joins the runs'.
Nothing here imports JAX, so the check runs anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import os
import sys
import textwrap

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CEILING = "ceiling"  # the op of the copy and read ceilings' rows
# A peer whose normwise relative error reaches this computes something else (e.g. FA3's
# non-causal attention backward, 1e4; 16-bit rounding stays below 3e-2): it is no bar.
WRONG = 0.1


@dataclasses.dataclass(frozen=True)
class Section:
  """One op's table: ``name``.json's rows; ``ours``: our default's impl label (also
  matching "label (...)", where the benchmark names the kernel that runs); ``hidden``:
  impls left to the full table besides our other variants (every other "jaxsoftmax"
  impl)."""
  name: str
  title: str
  ours: str = "jaxsoftmax"
  hidden: tuple[str, ...] = ()
  time_unit: str = "us"

  def is_ours(self, impl: str) -> bool:
    return impl == self.ours or impl.startswith(self.ours + " (")

  def is_peer(self, impl: str) -> bool:
    return not impl.startswith("jaxsoftmax") and impl not in self.hidden


SECTIONS = (
    Section("softmax", "softmax, log_softmax, logsumexp"),
    Section("cross_entropy", "cross_entropy (integer labels)"),
    Section("norms", "layer_norm, rms_norm"),
    Section("attention", "dot_product_attention", ours="jaxsoftmax mosaic_gpu"),
    Section("attention_backward", "dot_product_attention, the backward alone",
            ours="jaxsoftmax mosaic_gpu"),
    Section("linear_cross_entropy", "linear_cross_entropy (output layer + loss)",
            ours="jaxsoftmax fused", hidden=("dot + jaxsoftmax ce",), time_unit="ms"),
    Section("decode_attention", "decode_attention (KV cache)", ours="jaxsoftmax triton"),
)
RING = "ring_attention"
# Files here besides the ops' .json/.md/.png and this README: pattern -> what they are.
OTHER = {
    "tuning": "the sweeps, A/B runs and counters that code comments cite for a default "
              "([tuning/README.md](tuning/README.md))",
    RING + "_timelines": "the kernel timelines of the ring benchmark's traced calls "
                         "(`benchmarks/bench_ring_attention.py`)",
    "accuracy_rows.log": "the row ops' errors against XLA's over many seeds "
                         "(`benchmarks/accuracy_rows.py`)",
    "accuracy_linear_cross_entropy.log": "per-row loss errors of both forward kernels and "
                                         "of XLA's product, H = 4096 and 8192 "
                                         "(`benchmarks/accuracy_linear_cross_entropy.py`)",
    "attention_features.*": "what attention sinks, ALiBi, a bias and a mask array cost "
                            "beside the plain kernel and beside cuDNN with the same bias "
                            "and mask, and forward mode (jvp) beside XLA's "
                            "(`benchmarks/bench_attention_features.py`). Four runs, listed "
                            "in its JSON's meta: the sinks rows (joined in the forward "
                            "kernels' epilogue: 1.00-1.01x on the Hopper kernels, "
                            "0.92-1.00x on the Triton ones) from the second, the causal "
                            "bias-heads and mask rows from the third, the jvp rows (the "
                            "tangent kernel, 2.3x XLA's speed full and 5.2x causal) from "
                            "the fourth, the rest from the first; each feature's cost is "
                            "over the latest run's plain row (the runs' plain rows agree "
                            "within 1.3%)",
    "generate.log": "`examples/generate.py` at its GPU size (batch 64, 4 layers): tokens "
                    "per second and step time of jax.nn's attention and decode_attention "
                    "on contiguous and paged caches, and how their logits and tokens agree",
    "command_buffers.log": "the example's training step with XLA's command buffers (CUDA "
                           "graphs) on and off, and the thunks they hold "
                           "(`benchmarks/command_buffers.py`)",
}
DASH = "—"
WIDTH = 90  # of the README's prose


def accounted_for(name: str) -> bool:
  """Whether this README accounts for ``name`` in the results directory: an op's output,
  the README itself, or one of OTHER's."""
  ops = [*(s.name for s in SECTIONS), RING]
  return (name == "README.md" or name in {f"{op}.{ext}" for op in ops
                                            for ext in ("json", "md", "png")}
          or any(fnmatch.fnmatch(name, p) for p in OTHER))


# --- formatting ---------------------------------------------------------------------


def _num(v, spec: str) -> str:
  if v is None:
    return DASH
  return "NaN" if isinstance(v, float) and math.isnan(v) else format(v, spec)


def _time(us, unit: str) -> str:
  if us is None:
    return DASH
  value = us / 1e3 if unit == "ms" else us
  return format(value, ".1f" if value < 1000 else ".0f")


def _times(row, unit: str) -> str:
  if row is None or row.get("median_us") is None:
    return DASH
  return f"{_time(row['median_us'], unit)} / {_time(row['wall_us'], unit)}"


def _wrap(line: str) -> list[str]:
  """A line of prose (or a list item) wrapped for reading in a diff; tables stay whole."""
  if line.startswith(("|", "#")) or len(line) <= WIDTH:
    return [line]
  indent = "  " if line.startswith("- ") else ""
  return textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_long_words=False,
                       break_on_hyphens=False)


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
  return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
          + ["| " + " | ".join(cells) + " |" for cells in lines])


def _dates(meta) -> list[str]:
  runs = meta.get("runs")
  return [r["date"] for r in runs] if runs else meta["date"].split(" + ")


def _machine(meta) -> str:
  devices = meta.get("devices", 1)
  return f"{devices} x {meta['device']}" if devices > 1 else meta["device"]


def _intro(name: str, title: str, meta, results: str) -> list[str]:
  dates = sorted(_dates(meta))
  when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
  links = [f"[{name}.{ext}]({name}.{ext})" for ext in ("md", "json", "png")
           if os.path.exists(os.path.join(results, f"{name}.{ext}"))]
  return [f"## {title}", "",
          f"{_machine(meta)}, JAX {meta['jax']}, measured {when}. "
          f"Full table, data and plot: {', '.join(links)}.", ""]


def _runs(meta) -> list[str]:
  runs = meta.get("runs")
  if not runs:
    return [f"Run: {meta['date']}, every row."]
  lines = ["Runs (each shape's rows come from one):", ""]
  for run in runs:
    what = ", ".join(run["shapes"])
    modes = f" ({', '.join(run['modes'])})" if run.get("modes") else ""
    command = f" `{run['command']}`." if run.get("command") else ""
    note = f" {run['note'][0].upper()}{run['note'][1:]}." if run.get("note") else ""
    # A run merged from its own file names it (kept in git history).
    source = f", `{run['file']}` (in git history)" if run.get("file") else ""
    lines.append(f"- {run['date']}{source}: {what}{modes}.{command}{note}")
  return lines


# --- the harness reports -------------------------------------------------------------


def _right(rows) -> list:
  """The measured ``rows`` whose results are right: finite errors, below WRONG."""
  return [r for r in rows if r.get("median_us") is not None
          and r.get("max_rel_err") is not None and r["max_rel_err"] < WRONG]


def _rate(row, tflops: bool) -> str:
  if row is None or row.get("median_us") is None:
    return DASH
  if tflops:
    e2e = row["tflops"] * row["median_us"] / row["wall_us"]
    return f"{row['tflops']:.0f} / {e2e:.0f}"
  pct = "" if row.get("pct_ceiling") is None else f" ({row['pct_ceiling']:.0f}% {row['ceiling']})"
  return f"{row['gbps']:.0f}{pct}"


def _harness_section(section: Section, report, results: str) -> list[str]:
  meta, rows = report["meta"], [r for r in report["rows"] if r["op"] != CEILING]
  tflops = any(r.get("tflops") is not None for r in rows)
  groups: dict[tuple, dict] = {}
  for r in rows:
    groups.setdefault((r["op"], r["mode"], r["shape"], r["dtype"]), {})[r["impl"]] = r
  peers = list(dict.fromkeys(r["impl"] for r in rows if section.is_peer(r["impl"])))
  unit = section.time_unit
  header = ["op", "mode", "shape", "dtype", f"{section.ours}, {unit}",
            "TFLOP/s" if tflops else "GB/s", *(["peak MiB"] if tflops else []), "err"]
  for peer in peers:
    header += [f"{peer}, {unit}", "err"]
  header += ["fastest peer", "speed-up"]
  lines, notes = [], {}
  for (op, mode, shape, dtype), group in groups.items():
    ours = next((r for impl, r in group.items() if section.is_ours(impl)), None)
    cells = [op, mode, shape, dtype, _times(ours, unit), _rate(ours, tflops)]
    if tflops:
      cells.append(_num(ours and ours.get("peak_mib"), ".0f"))
    cells.append(_num(ours and ours.get("max_rel_err"), ".1e"))
    for peer in peers:
      row = group.get(peer)
      cells += [_times(row, unit), _num(row and row.get("max_rel_err"), ".1e")]
    for row in (ours, *(group.get(p) for p in peers)):
      if row is not None and row.get("note"):
        notes.setdefault((row["impl"], row["note"]), []).append(f"{op} {mode} {shape} {dtype}")
    right = _right([group[p] for p in peers if p in group])
    if ours is None or ours.get("median_us") is None or not right:
      cells += [DASH, DASH]
    else:
      best = min(right, key=lambda r: r["median_us"])
      best_wall = min(r["wall_us"] for r in right)
      cells += [best["impl"], f"{best['median_us'] / ours['median_us']:.2f}x / "
                              f"{best_wall / ours['wall_us']:.2f}x"]
    lines.append(cells)
  variants = sorted({r["impl"] for r in rows if not section.is_ours(r["impl"])
                     and not section.is_peer(r["impl"])})
  out = _intro(section.name, section.title, meta, results)
  out += [f"Ours: `{section.ours}`" + (f"; the full table also has "
                                       f"{', '.join(f'`{v}`' for v in variants)}."
                                       if variants else "."), ""]
  out += _table(header, lines) + [""]
  if notes:
    appears = {impl: sum(impl in g for g in groups.values()) for impl, _ in notes}
    out += ["Notes:", ""]
    out += [f"- `{impl}`, {'every row' if len(where) == appears[impl] else '; '.join(where)}: "
            f"{note}" for (impl, note), where in notes.items()]
    out += [""]
  return out + _runs(meta) + [""]


# --- ring attention ------------------------------------------------------------------


def _ring_section(report, results: str) -> list[str]:
  meta, rows = report["meta"], report["rows"]
  cases: dict[tuple, dict] = {}
  for r in rows:
    cases.setdefault((r["T"], r["N"], r["K"], r["causal"], r["mode"]), {})[r["impl"]] = r
  # The compact table: one device, and each strategy on every device as it runs by
  # default (without XLA's latency-hiding scheduler, the rows ending ", LHS").
  prefixes = {f"{meta['devices']} devices {s}" for s in ("ring", "all_gather")}
  shown = lambda impl: impl == "1 device" or (impl.rsplit(" ", 1)[0] in prefixes
                                              and not impl.endswith(", LHS"))

  def pick(group, strategy):
    return next((r for impl, r in group.items() if shown(impl) and strategy in impl), None)

  def timed(r):
    if r is None or r.get("wall_us") is None:
      return DASH
    return f"{r['wall_us'] / 1e3:.1f}" + ("" if r["impl"] == "1 device"
                                          else f" ({r['speedup']:.2f}x)")

  header = ["T", "N/K", "causal", "mode", "1 device ms", "ring ms (speed-up)",
            "all-gather ms (speed-up)", "max abs diff from 1 device: ring / all-gather",
            "ring's NCCL us / under compute"]
  lines = []
  for (T, N, K, causal, mode), group in cases.items():
    ring, gather = pick(group, " ring "), pick(group, " all_gather ")
    diff = " / ".join(_num(r and r.get("max_abs_diff"), ".1e") for r in (ring, gather))
    nccl = (DASH if ring is None or ring.get("nccl_us") is None
            else f"{ring['nccl_us']:.0f} / {ring['nccl_hidden_us']:.0f}")
    lines.append([str(T), f"{N}/{K}", "yes (zigzag)" if causal else "no (contiguous)", mode,
                  timed(group.get("1 device")), timed(ring), timed(gather), diff, nccl])
  variants = sorted({r["impl"] for r in rows if not shown(r["impl"])})
  head_dims = ", ".join(str(h) for h in sorted({r["H"] for r in rows}))
  out = _intro(RING, "ring_attention (context parallelism)", meta, results)
  out += [f"Head dim {head_dims}. Wall time per call (median of 3 runs of 10 back-to-back "
          "calls, inputs placed); speed-up over our attention on one "
          "device for the same problem; the NCCL time of one traced call on device 0 and "
          "the part of it under compute kernels (the ring's overlap)"
          + (f"; the full table also has {', '.join(f'`{v}`' for v in variants)}"
             if variants else "") + ".", ""]
  return out + _table(header, lines) + [""] + _runs(meta) + [""]


# --- the README ----------------------------------------------------------------------


def _load(results: str, name: str):
  path = os.path.join(results, name + ".json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def render(results: str = RESULTS) -> str:
  reports = {s.name: _load(results, s.name) for s in SECTIONS}
  timers = sorted({r["timer"] for rep in reports.values() if rep for r in rep["rows"]
                   if r.get("median_us") is not None and r["op"] != CEILING})
  out = ["# Benchmark results: today's numbers", "",
         "Generated by `python benchmarks/results_readme.py` from the JSON files here "
         "(do not edit by hand). Each op's table holds, for each of its shapes, the rows "
         "of the latest run that measured it. The runs are listed under the table; commits "
         "after a run's date are not in its numbers. Superseded runs are in git history "
         "(`git log -- benchmarks/results`).", "",
         "## Method", "",
         "Each benchmark (`benchmarks/bench_*.py`, through `benchmarks/harness.py`) runs "
         "jaxsoftmax and its peers in one process on the same inputs, and each shape's rows "
         "below come from one run (listed under each table): compare within a row, since "
         "the same kernel moves by a few percent from run to run. Times are device / wall: "
         "the device time is the median over 20 iterations of the summed durations of the "
         f"kernels one call launches (timer: {', '.join(timers)}), inputs rotated past L2; "
         "wall is the end-to-end time per call, wall clock over 20 pipelined calls (median "
         "of 3). GB/s count the minimum traffic, beside the percentage of a Pallas copy or "
         "read ceiling measured in the same run; TFLOP/s (device / end to end) count the "
         "FLOPs each .md's header names; peak MiB is the compiled call's temporaries and "
         "outputs. err: the normwise relative error max|out - truth| / max|truth| against a "
         "float64 truth computed on the device, the largest over outputs and gradients. "
         "Speed-up: the fastest peer's time over ours, device / wall, among the peers "
         f"whose errors are finite and below {WRONG:.0%} (a peer with NaN, or with "
         "results off by orders of magnitude, is no bar). The "
         "protocol: [docs/benchmarks.md](../../docs/benchmarks.md).", "",
         "Refresh: write an op's files with its benchmark (`--out benchmarks/results`) or "
         "merge a partial run into them (`benchmarks/merge_reports.py`), then run "
         "`python benchmarks/results_readme.py`.", ""]
  for section in SECTIONS:
    if reports[section.name] is not None:
      out += _harness_section(section, reports[section.name], results)
  ring = _load(results, RING)
  if ring is not None:
    out += _ring_section(ring, results)
  present = [(p, what) for p, what in OTHER.items()
             if any(fnmatch.fnmatch(f, p) for f in os.listdir(results))]
  if present:
    slash = lambda p: p + "/" if os.path.isdir(os.path.join(results, p)) else p
    out += ["## Other files", ""] + [f"- `{slash(p)}`: {what}." for p, what in present] + [""]
  return "\n".join(w for line in out for w in _wrap(line)) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--results", default=RESULTS, help="the results directory")
  parser.add_argument("--check", action="store_true",
                      help="exit 1 if README.md differs from what the data gives")
  args = parser.parse_args(argv)
  text = render(args.results)
  path = os.path.join(args.results, "README.md")
  if args.check:
    with open(path) as f:
      if f.read() != text:
        sys.exit(f"{path} is out of date: run python benchmarks/results_readme.py")
    return
  with open(path, "w") as f:
    f.write(text)


if __name__ == "__main__":
  main()
