"""Where a kernel's warps wait, from Nsight Compute's per-instruction stall samples: reads
the SASS table that `run_gpu.sh`'s attn-ncu stage writes with NCU_SOURCE=1 (`ncu --import
REPORT --page source --print-source sass --csv`) and prints, for the whole kernel and for
its per-step code, the share of the samples by stall reason, then the instructions with
the most samples.

    python3 benchmarks/ncu_stalls.py ncu_mosaic_gpu.sass.log [--top 25] [--step-share 0.4]

The per-step code: the instructions executed at least ``--step-share`` times, and at
most once, as often as the step count: the number of executions whose instructions
executed the most in all (a loop body's; the retry loops of barrier waits run more
often, but are few). In a warp-specialized kernel those are the consumers' loop, both
branches of a step where each consumer takes one; the producer's and the writer's waits
(warps that spend their time waiting by design) fall outside it, so its shares say what
holds the consumers back. Stall reasons are Nsight Compute's (its Profiling Guide,
"Warp Stall Reasons"): e.g. ``barrier`` a warpgroup wait on wgmma or a named barrier,
``long_sb`` a wait on global or local memory or on an mbarrier poll, ``short_sb`` on
shared memory or MUFU.
"""

from __future__ import annotations

import argparse
import collections
import csv

_SAMPLES = "Warp Stall Sampling (All Samples)"
_EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return 0.0


def read(path: str) -> tuple[str, list[str], list[dict]]:
  """(kernel name, stall columns, one dict per SASS instruction) of an ncu source CSV."""
  with open(path) as f:
    rows = list(csv.reader(f))
  kernel = rows[0][1] if rows and len(rows[0]) > 1 else "?"
  header = rows[1]
  stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
  table = [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]
  return kernel, stalls, table


def shares(table, stalls) -> list[tuple[str, float]]:
  """(reason, share of the samples) over ``table``, largest first."""
  totals = collections.Counter()
  for row in table:
    for s in stalls:
      totals[s] += _number(row[s])
  total = sum(totals.values()) or 1.0
  return [(s.removeprefix("stall_"), v / total) for s, v in totals.most_common() if v]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("path")
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--step-share", type=float, default=0.4)
  args = parser.parse_args()
  kernel, stalls, table = read(args.path)
  executed = [_number(r[_EXECUTED]) for r in table]
  samples = [_number(r[_SAMPLES]) for r in table]
  total = sum(samples) or 1.0
  # Counts within about 1% of each other are one count.
  work = collections.Counter()
  for e in executed:
    work[float(f"{e:.2g}")] += e
  steps = max(work, key=work.get, default=0.0)
  step = [i for i, e in enumerate(executed)
          if steps and args.step_share * steps <= e <= 1.01 * steps]
  print(f"kernel: {kernel[:120]}")
  print(f"{len(table)} SASS instructions, {sum(executed) / 1e6:.1f} M warp-instructions "
        f"executed, {total:.0f} stall samples")
  print(f"step count {steps / 1e3:.0f} K (warp-steps); the per-step code: {len(step)} "
        f"instructions, {sum(samples[i] for i in step) / total:.0%} of the samples, "
        f"{sum(executed[i] for i in step) / max(steps, 1):.0f} executed a warp-step")
  for name, rows in (("whole kernel", table), ("per-step code", [table[i] for i in step])):
    print(f"{name}: " + ", ".join(f"{s} {v:.1%}" for s, v in shares(rows, stalls)[:9]))
  print(f"\nthe {args.top} instructions with the most samples (index in the SASS, share, "
        "times executed, the two main reasons):")
  order = sorted(range(len(table)), key=lambda i: -samples[i])[:args.top]
  for i in order:
    row = table[i]
    reasons = sorted(((_number(row[s]), s.removeprefix("stall_")) for s in stalls),
                     reverse=True)[:2]
    print(f"{i:5d} {samples[i] / total:6.1%} {executed[i] / 1e3:7.0f}K  "
          f"{row['Source'].strip()[:64]:64s} "
          + " ".join(f"{s} {v:.0f}" for v, s in reasons if v))


if __name__ == "__main__":
  main()
