"""Merges benchmark reports of runs split by the device's time limit into one.

    python benchmarks/merge_reports.py OUT_DIR NAME first.json second.json ...

Rows are keyed by (op, impl, shape, dtype, mode); a later file's row replaces an earlier
one's, so re-measured shapes win. Writes NAME.json/.md/.png; the header lists the runs'
dates, and the merged meta keeps each run's entry in "runs" (what it measured and with
which command, where a report records it).
"""

from __future__ import annotations

import json
import sys

import bench_attention
import bench_attention_features
import bench_decode_attention
import bench_linear_cross_entropy
import harness

# The TFLOP/s reports: what their FLOPs count, and the table that ends them.
_TFLOPS_REPORTS = {
    "linear_cross_entropy": (bench_linear_cross_entropy.FLOPS_DOC, None),
    "attention_features": (harness.ATTENTION_FLOPS, bench_attention_features.feature_costs),
}
_ATTENTION = (harness.ATTENTION_FLOPS, bench_attention.vs_best_peer)
# The GB/s reports' closing tables.
_GBPS_SUMMARIES = {"decode_attention": bench_decode_attention.vs_best_peer}


def main(out_dir: str, name: str, paths: list[str]):
  rows, metas = {}, []
  for path in paths:
    with open(path) as f:
      report = json.load(f)
    metas.append(report["meta"])
    for row in report["rows"]:
      row = harness.Row(**row)
      rows[(row.op, row.impl, row.shape, row.dtype, row.mode)] = row
  units = {"TFLOP/s" if r.tflops is not None else "GB/s"
           for r in rows.values() if r.median_us is not None}
  if len(units) != 1:
    sys.exit(f"cannot merge reports with units {units}")
  unit = units.pop()
  flops_doc, summary = harness.ATTENTION_FLOPS, _GBPS_SUMMARIES.get(name)
  if unit == "TFLOP/s":  # attention's unless the report is one of the others
    flops_doc, summary = _TFLOPS_REPORTS.get(name, _ATTENTION)
  merged = harness.Report(name, total=len(rows), out_dir=out_dir, unit=unit,
                          summary=summary, flops_doc=flops_doc)
  runs = [run for m in metas for run in m.get("runs", [{"date": m["date"]}])]
  merged.meta = dict(metas[-1], date=" + ".join(run["date"] for run in runs), runs=runs)
  merged.rows = list(rows.values())
  merged._write_tables()
  merged.finish()
  print(f"{len(merged.rows)} rows from {len(paths)} runs", file=sys.stderr)


if __name__ == "__main__":
  if len(sys.argv) < 4:
    sys.exit(__doc__)
  main(sys.argv[1], sys.argv[2], sys.argv[3:])
