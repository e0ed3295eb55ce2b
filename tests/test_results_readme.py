"""benchmarks/results/README.md is what `benchmarks/results_readme.py` makes of the data
beside it, the results directory holds only what that README accounts for, and every
results file the code and docs cite exists."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import results_readme  # noqa: E402


def test_readme_is_up_to_date():
  with open(os.path.join(results_readme.RESULTS, "README.md")) as f:
    assert f.read() == results_readme.render(), (
        "benchmarks/results/README.md is stale: run python benchmarks/results_readme.py")


def test_every_committed_file_is_accounted_for():
  # Committed files only: a run's outputs may sit in the tree until they are merged.
  try:
    tracked = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
  except (OSError, subprocess.CalledProcessError):
    pytest.skip("not a git checkout")
  names = {os.path.relpath(path, "benchmarks/results").split("/")[0] for path in tracked}
  extra = {name for name in names if not results_readme.accounted_for(name)}
  assert not extra, f"files the README does not account for: {sorted(extra)}"


def test_cited_results_exist():
  cited = set()
  sources = [*glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True),
             *glob.glob(os.path.join(ROOT, "docs", "*.md")), os.path.join(ROOT, "README.md")]
  for path in sources:
    if os.sep + ".venv" + os.sep in path:
      continue
    with open(path, encoding="utf-8") as f:
      cited |= {(os.path.relpath(path, ROOT), m.rstrip(".,;:"))
                for m in re.findall(r"benchmarks/results/[\w./*+-]*", f.read())}
  missing = sorted((source, target) for source, target in cited
                   if not glob.glob(os.path.join(ROOT, target)))
  assert not missing, f"citations of files that do not exist: {missing}"


def _row(impl, median_us, wall_us, err, **extra):
  return dict(op="softmax", impl=impl, shape="8x128", dtype="float32", mode="fwd",
              max_abs_err=err, max_rel_err=err, median_us=median_us, wall_us=wall_us,
              gbps=None if median_us is None else 8.0, pct_ceiling=50.0, ceiling="copy",
              timer="cupti", note="", tflops=None, peak_mib=None) | extra


def test_table_of_a_report(tmp_path):
  report = dict(meta=dict(device="GPU X", jax="0.1", backend="gpu", date="2026-01-02 03:04 UTC"),
                rows=[_row("jaxsoftmax", 10.0, 20.0, 1e-7),
                      _row("xla (jax.nn)", 15.0, 25.0, 2e-7),
                      _row("pallas ops softmax", 5.0, 5.0, float("nan")),  # wrong: no bar
                      _row("other", None, None, None, note="ImportError: absent")])
  with open(tmp_path / "softmax.json", "w") as f:
    json.dump(report, f)
  text = results_readme.render(str(tmp_path))
  assert "GPU X, JAX 0.1, measured 2026-01-02 03:04 UTC." in text
  row = next(line for line in text.splitlines() if line.startswith("| softmax | fwd |"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[4:7] == ["10.0 / 20.0", "8 (50% copy)", "1.0e-07"]
  assert cells[7:9] == ["15.0 / 25.0", "2.0e-07"]
  assert cells[10] == "NaN"
  assert cells[-2:] == ["xla (jax.nn)", "1.50x / 1.25x"]  # the NaN peer is no bar
  assert "- `other`, every row: ImportError: absent" in text
  assert "Run: 2026-01-02 03:04 UTC, every row." in text
