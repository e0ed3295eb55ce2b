"""The benchmarks, the report merge and the long-context example run end to end
(--smoke: tiny shapes, interpreted kernels), so that the scripts the GPU run depends on do
not rot off-GPU."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_GPU = jax.default_backend() == "gpu"


def _run(*args, cwd=ROOT):
  # The scripts inherit conftest.py's XLA flags (without a GPU: no LLVM optimizations).
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "benchmarks")]))
  return subprocess.run([sys.executable, *args], cwd=cwd, env=env, check=True,
                        capture_output=True, text=True, timeout=600)


def _benchmark_module(name: str):
  """A module of benchmarks/, imported as the scripts import each other."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  try:
    return __import__(name)
  finally:
    sys.path.pop(0)


def _smoke_rows(tmp_path, script: str, name: str, *args) -> list:
  """The rows a benchmark script's --smoke run writes to tmp_path/name.json."""
  pytest.importorskip("matplotlib")  # the reports' plots; in the "test" extra
  _run(f"benchmarks/{script}.py", "--smoke", *args, "--out", str(tmp_path))
  with open(tmp_path / f"{name}.json") as f:
    return json.load(f)["rows"]


def test_bench_attention_smoke_and_merge(tmp_path):
  rows = _smoke_rows(tmp_path, "bench_attention", "attention")
  ours = [r for r in rows if r["impl"] == "jaxsoftmax triton"]
  assert {r["mode"] for r in ours} == {"fwd", "fwd+bwd"}
  assert all(r["median_us"] > 0 and r["max_rel_err"] < 0.05 for r in ours)
  # Peers (and backends) that cannot run here are rows that say why, not crashes.
  assert all(r["note"] for r in rows if r["median_us"] is None)
  assert any("needs a Hopper GPU" in r["note"] for r in rows
             if r["impl"] == "jaxsoftmax mosaic_gpu")
  with open(tmp_path / "attention.md") as f:
    assert "## Ours against the fastest peer" in f.read()  # no peer runs here to compare

  _run("benchmarks/merge_reports.py", str(tmp_path / "merged"), "both",
       str(tmp_path / "attention.json"), str(tmp_path / "attention.json"))
  with open(tmp_path / "merged" / "both.json") as f:
    assert len(json.load(f)["rows"]) == len(rows)  # same keys: replaced, not repeated


def test_bench_ring_attention_smoke(tmp_path, monkeypatch):
  # The script end to end as a user without a GPU runs it, on the XLA path (its
  # interpreted kernels took 90 of the 120 s; tests/test_ring_attention.py runs them).
  monkeypatch.delenv("JAXSOFTMAX_INTERPRET", raising=False)
  rows = _smoke_rows(tmp_path, "bench_ring_attention", "ring_attention", "--lhs")
  # Per case: one device, then the ring (with --lhs also under XLA's latency-hiding
  # scheduler: an option every backend parses) and all-gather strategies on the 8 CPU
  # devices.
  assert {r["impl"] for r in rows} == {"1 device", "8 devices ring zigzag",
                                       "8 devices ring zigzag, LHS",
                                       "8 devices all_gather zigzag",
                                       "8 devices ring contiguous",
                                       "8 devices ring contiguous, LHS",
                                       "8 devices all_gather contiguous"}
  assert all(r["wall_us"] > 0 for r in rows)
  # The context-parallel results against one device's (float32).
  assert all(r["max_abs_diff"] < 1e-5 for r in rows if r["impl"] != "1 device")


def test_profile_ring_attention_smoke(tmp_path, monkeypatch):
  # As test_bench_ring_attention_smoke: the XLA path (the interpreted kernels on the 8
  # devices took two thirds of its time; tests/test_ring_attention.py runs them).
  monkeypatch.delenv("JAXSOFTMAX_INTERPRET", raising=False)
  out = _run("benchmarks/profile_ring_attention.py", "--smoke", "--out", str(tmp_path)).stdout
  assert "1_device" in out and "8_devices" in out, out
  for name in ("1_device", "8_devices"):
    with open(tmp_path / f"ring_profile_{name}.json") as f:
      assert json.load(f)  # the trace's planes


def test_long_context_example(monkeypatch):
  # As a user without a GPU runs it: the XLA path (tests/test_ring_attention.py runs the
  # interpreted kernels over the same devices).
  monkeypatch.delenv("JAXSOFTMAX_INTERPRET", raising=False)
  out = _run("examples/long_context.py", "--tokens", "64", "--repeats", "1").stdout
  for name in ("output", "dq", "dk", "dv"):
    diff = float(out.split(f"{name}: largest difference from one device ")[1].split()[0])
    assert diff < 1e-5, (name, out)


def test_transformer_example_learns_on_a_cpu(monkeypatch):
  # examples/run as a user without a GPU runs it: the XLA path, and the loss falls.
  if ON_GPU:
    pytest.skip("on a GPU the example runs at its GPU size (run_gpu.sh's example stage)")
  monkeypatch.delenv("JAXSOFTMAX_INTERPRET", raising=False)
  out = _run("examples/train_transformer.py").stdout
  first, last = (float(v) for v in out.split("the loss fell from ")[1].split(" (")[0]
                 .split(" to "))
  assert last < 0.6 * first and "OK:" in out, out


def test_bench_linear_cross_entropy_smoke(tmp_path):
  rows = _smoke_rows(tmp_path, "bench_linear_cross_entropy", "linear_cross_entropy")
  # Every row ran, the Triton and xla_chunks backends named among them.
  assert len(rows) == 16 and sum("Triton fwd" in r["impl"] for r in rows) == 2
  assert sum(r["impl"] == "jaxsoftmax xla_chunks" for r in rows) == 2
  assert all(r["median_us"] > 0 and r["max_rel_err"] < 1e-5 for r in rows)


def test_bench_norms_smoke(tmp_path):
  rows = _smoke_rows(tmp_path, "bench_norms", "norms", "--modes", "fwd,step")
  ours = [r for r in rows if r["impl"] == "jaxsoftmax"]
  # layer_norm and rms_norm, plain and with the residual, forward and the backward
  # through y @ w; in float32, and in bfloat16 with bfloat16 and with float32 parameters.
  f32 = [r for r in ours if r["dtype"] == "float32"]
  assert len(f32) == 8 and all(r["max_rel_err"] < 1e-4 for r in f32)
  assert len(ours) == 24 and all(r["max_rel_err"] < 2e-2 for r in ours)
  assert sum(r["op"].endswith("f32 params") for r in ours) == 8
  assert sum(r["mode"] == "step" for r in ours) == 12
  assert all(r["note"] for r in rows if r["median_us"] is None)


def test_bench_decode_attention_smoke(tmp_path):
  rows = _smoke_rows(tmp_path, "bench_decode_attention", "decode_attention")
  # Per smoke case (T = 1 and T = 2): the read ceiling, the seven contiguous rows and the
  # six paged ones (FA3 at three split counts; page size 16, S = 100 not a multiple of it).
  assert len(rows) == 28 and sum(r["op"] == "ceiling" for r in rows) == 2
  # Ours and XLA's ran on both layouts, right against the float64 truth (bfloat16).
  for T in (1, 2):
    for mode in ("contiguous", "paged 16"):
      for impl in ("jaxsoftmax triton", "xla"):
        [r] = [r for r in rows if (r["op"], r["mode"], r["impl"]) == (f"decode T={T}", mode,
                                                                       impl)]
        assert r["median_us"] > 0 and r["gbps"] > 0 and r["max_rel_err"] < 2e-2, r
        assert r["ceiling"] == "read"
        assert impl != "jaxsoftmax triton" or r["note"].startswith("splits "), r
  if not ON_GPU:  # Pallas' own decode kernels, interpreted (T = 1 only)
    pallas = [r for r in rows if r["impl"].startswith("pallas ") and r["op"] != "ceiling"]
    ran = {(r["op"], r["mode"]) for r in pallas if r["median_us"] is not None}
    # JAX 0.12.1 no longer ships Pallas' Triton decode kernels: their rows say so.
    if importlib.util.find_spec("jax.experimental.pallas.ops.gpu.decode_attention"):
      assert ran == {("decode T=1", "contiguous"), ("decode T=1", "paged 16")}
    else:
      assert not ran and all("not importable" in r["note"] for r in pallas
                             if r["op"] == "decode T=1")
    assert all(r["max_rel_err"] < 2e-2 for r in pallas if r["median_us"] is not None)
  # Peers that cannot run here (cuDNN and FA3 need a GPU, FA3 its wheel; T > 1 for the
  # one-query kernels) are rows that say why, not crashes.
  assert all(r["note"] for r in rows if r["median_us"] is None)
  with open(tmp_path / "decode_attention.md") as f:
    assert "## Ours against the fastest peer" in f.read()


def test_bench_attention_backward_smoke(tmp_path, monkeypatch):
  monkeypatch.setenv("HOPPER_BWD_SCHEDULES", "stale+fa3,wide+det,ordered+det")
  monkeypatch.setenv("BENCH_ROUNDS", "2")  # the rows in interleaved rounds
  rows = _smoke_rows(tmp_path, "bench_attention_backward", "attention_backward")
  with open(tmp_path / "attention_backward.md") as f:
    assert "timed in 2 rounds of 10 that alternate the rows' order" in f.read()
  # The backward alone, timed from the forward's residuals: ours on Triton runs here.
  [triton] = [r for r in rows if r["impl"] == "jaxsoftmax triton (Triton backward)"]
  assert triton["mode"] == "bwd" and triton["median_us"] > 0
  assert triton["max_rel_err"] < 0.05
  assert all(r["note"] for r in rows if r["median_us"] is None)
  # A row per schedule asked for, which off a Hopper GPU says why it did not run.
  for schedule in ("stale+fa3", "wide+det", "ordered+det"):
    [row] = [r for r in rows if r["impl"] == f"jaxsoftmax mosaic_gpu {schedule}"]
    assert "needs a Hopper GPU" in row["note"]


def test_bench_attention_features_smoke(tmp_path):
  rows = _smoke_rows(tmp_path, "bench_attention_features", "attention_features",
                     "--modes", "fwd+bwd,jvp")
  # Every feature on the Triton kernels in both modes asked for, each with its error;
  # forward mode beside XLA's; the cost table at the end.
  features = ("plain", "sinks", "alibi", "bias keys", "bias heads", "mask", "mask keys",
              "mask keys holes", "key lengths", "segments packed")
  assert {r["mode"] for r in rows} == {"fwd+bwd", "jvp"}
  for mode, extra in (("fwd+bwd", ("bias heads grad",)), ("jvp", ())):
    triton = {r["impl"] for r in rows if r["impl"].startswith("jaxsoftmax triton")
              and r["mode"] == mode and r["median_us"] is not None and r["max_rel_err"] < 0.05}
    assert triton == {f"jaxsoftmax triton {f}" for f in features + extra}, mode
  xla = {(r["impl"], r["mode"]) for r in rows if r["impl"].startswith("xla")
         and r["median_us"] is not None and r["max_rel_err"] < 0.05}
  assert xla == {(f"xla {f}", "jvp") for f in features}
  assert all(r["note"] for r in rows if r["median_us"] is None)
  with open(tmp_path / "attention_features.md") as f:
    assert "## Cost of each feature" in f.read()


def test_plane_tile_stages_smoke(tmp_path):
  rows = _smoke_rows(tmp_path, "plane_tile_stages", "plane_tile_stages")
  # The plain forward at its tiles and a stage fewer, then each feature at the default
  # tiles and, with the plain call, at 128 x 64 tiles: each row with its error.
  names = [r["impl"].split(" (")[0] for r in rows]
  assert names == ["plain", "plain, a stage fewer", "mask", "bias heads", "plain", "mask",
                   "bias heads"]
  assert all(r["median_us"] > 0 and r["max_rel_err"] < 0.05 for r in rows)
  assert rows[0]["impl"] != rows[1]["impl"]  # the stage count names the cut


def test_tune_norms_smoke(tmp_path):
  rows = _smoke_rows(tmp_path, "tune_norms", "tune_norms")
  # Both ops, plain and with the residual, the forward and the backward alone, each on
  # several warp counts and on the default.
  for op in ("layer_norm", "layer_norm +res", "rms_norm", "rms_norm +res"):
    for mode in ("fwd", "bwd"):
      swept = [r for r in rows if r["op"] == op and r["mode"] == mode]
      assert len(swept) >= 3 and all(r["median_us"] > 0 for r in swept), (op, mode)
      assert [r["impl"] for r in swept].count("default") == 1


def test_profile_linear_cross_entropy_smoke(tmp_path):
  _run("benchmarks/profile_linear_cross_entropy.py", "--smoke", "--out", str(tmp_path))
  report = (tmp_path / "profile_linear_cross_entropy.md").read_text()
  # Both steps, each with its memory analysis (kernels appear only on a GPU).
  assert report.count("temporaries + outputs") == 2
  assert "## jaxsoftmax fused, 37x40x301" in report and "## x @ w + optax" in report


def test_profile_attention_kernels_smoke(tmp_path):
  _run("benchmarks/profile_attention_kernels.py", "--smoke", "--impls",
       "jaxsoftmax triton,no such impl", "--out", str(tmp_path))
  report = (tmp_path / "profile_attention_kernels.md").read_text()
  # Each implementation and mode once; one that cannot run says why (kernels appear
  # only on a GPU).
  for mode in ("fwd", "fwd+bwd"):
    assert report.count(f"## attention causal {mode}, jaxsoftmax triton, 1x64x2x1x32") == 1
  assert report.count("Span per call") == 2
  assert report.count("Not measured: no such implementation") == 2


def test_bench_delta_smoke():
  report = _run("benchmarks/bench_delta.py").stdout
  # Every variant timed, each delta the einsum's up to float32 rounding of sums of
  # size ~10, each zeroed dQ zero, and each delta's vmap compared with it.
  rows = [line for line in report.splitlines() if line.startswith("| ") and "---" not in line]
  assert len(rows) == 1 + 6
  assert "zeros not zero" not in report
  for row in rows[1:]:
    diff, same = (cell.strip() for cell in row.split("|")[-3:-1])
    assert diff == "-" or float(diff) < 1e-4, row
    assert (diff == "-") == (same == "-"), row  # the zeros alone have neither
    assert same in ("-", "yes") or re.fullmatch(r"no: \d+ of \d+ differ", same), row


def test_profile_rows_smoke(tmp_path):
  _run("benchmarks/profile_rows.py", "--smoke", "--ops", "softmax,logsumexp", "--out",
       str(tmp_path))
  report = (tmp_path / "profile_rows.md").read_text()
  # Each op, mode and implementation once; logsumexp forward only (kernels appear only on
  # a GPU).
  for title in ("softmax fwd, jaxsoftmax, 8x300 float32", "softmax fwd+bwd, xla (jax.nn), 8x300",
                "logsumexp fwd, jaxsoftmax, 2x5000 bfloat16"):
    assert report.count(f"## {title}") == 1, title
  assert "logsumexp fwd+bwd" not in report and report.count("Span per call") == 12


def test_profile_rows_norms_smoke(tmp_path):
  _run("benchmarks/profile_rows.py", "--smoke", "--ops", "rms_norm", "--modes", "fwd+bwd,bwd",
       "--out", str(tmp_path))
  report = (tmp_path / "profile_rows.md").read_text()
  for impl in ("jaxsoftmax", "xla", "flax nnx"):
    for mode in ("fwd+bwd", "bwd"):
      assert report.count(f"## rms_norm {mode}, {impl}, 16x300 float32") == 1, (impl, mode)
  assert "rms_norm fwd," not in report and report.count("Span per call") == 6
  with pytest.raises(subprocess.CalledProcessError) as mixed:
    _run("benchmarks/profile_rows.py", "--smoke", "--ops", "softmax,rms_norm", "--out",
         str(tmp_path))
  assert "not both" in mixed.value.stderr


def test_pullbacks_apply_each_sets_own_residuals():
  # The benchmarks' "bwd" mode: one compiled pullback fed each input set's residuals
  # gives that set's gradient, for a custom_jvp op of ours and for plain jnp.
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jaxsoftmax as js
  harness = _benchmark_module("harness")
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  xs = [jax.random.normal(k, (3, 40)) for k in keys[:2]]
  dys = [jax.random.normal(k, (3, 40)) for k in keys[2:]]
  for fn in (lambda x: js.log_softmax(x, interpret=True), lambda x: jnp.tanh(x) ** 2):
    call, residual_sets = harness.pullbacks(fn, [(x,) for x in xs])
    assert len(residual_sets) == 2
    for x, r, dy in zip(xs, residual_sets, dys):
      np.testing.assert_allclose(jax.jit(call)(r, dy)[0], jax.vjp(fn, x)[1](dy)[0],
                                 rtol=1e-6, atol=1e-6)


def test_kernel_timeline_helpers():
  # Two calls of two kernels each: a (2 us) then b (1 us), the second call 6 us later.
  harness = _benchmark_module("harness")
  planes = {"/host:CPU": {"python": [("a", 0.0, 99.0)]},
            "/device:GPU:0": {"Stream #1": [("a", 10.0, 2.0), ("b", 12.0, 1.0)],
                              "Stream #2": [("a", 0.0, 2.0), ("b", 3.0, 1.0)],
                              "XLA Ops": [("fusion", 0.0, 13.0)]}}
  kernels = harness.device_kernels(planes)
  assert [k[1] for k in kernels] == [0.0, 3.0, 10.0, 12.0]
  assert harness.kernel_groups(kernels, 2) == [("a", 1, 2.0), ("b", 1, 1.0)]
  assert harness.span_and_gaps(kernels, 2) == (6.5, [6.0, 1.0])
  assert harness.device_kernels({"/host:CPU": {}}) == []



def test_clock_sampler_reports_the_busy_clock_and_its_slowdowns(tmp_path):
  # Samples between kernels (NVML's idle reason) are left out; a power cap seen in any
  # busy sample is named, and the row's note in the table says so.
  harness = _benchmark_module("harness")
  samples = iter([(1980, 0x1), (1980, 0x0), (1755, 0x4), (1830, 0x4), (345, 0x1)])

  def read():
    try:
      return next(samples)
    except StopIteration:
      raise RuntimeError("no more samples") from None

  with harness.ClockSampler(period=0, read=read) as clocks:
    clocks._thread.join()  # it stops once read() fails
  assert clocks.result == (1830, 1755, "power cap")
  report = harness.Report("clocks", 1, str(tmp_path), unit="TFLOP/s")
  report.add(harness.Row("attention", "ours", "1x2", "bfloat16", "fwd", 0.0, 0.0, 10.0,
                         11.0, None, None, "", "cupti", tflops=1.0, peak_mib=1.0,
                         sm_mhz=1830, sm_mhz_min=1755, slowdowns="power cap"))
  table = report.markdown()
  assert "SM clock 1830 MHz (lowest 1755): power cap |" in table
  assert "lowered its SM clock" in table
  # A reader that fails at once (as NVML where there is no GPU) leaves no result.
  with harness.ClockSampler(read=read) as none:
    pass
  assert none.result is None

def test_measure_rounds_alternates_the_rows_order(tmp_path):
  # Three rows in two rounds: each prepared once, then timed A B C and C B A (the
  # context a row's calls run in sees each), each row's median over both rounds; a row
  # whose function fails becomes a row that says why, and the others go on.
  import jax.numpy as jnp
  harness = _benchmark_module("harness")
  seen = []

  def context(name):
    import contextlib

    @contextlib.contextmanager
    def enter():
      seen.append(name)
      yield
    return enter

  def fails(x):
    raise ValueError("no such kernel")

  x = jnp.ones(4)
  rows = [dict(op="op", impl=name, shape=(4,), dtype="float32", mode="fwd", fn=fn,
               arg_sets=[(x,)], nbytes=16, context=context(name), truth=x)
          for name, fn in (("a", jnp.exp), ("b", fails), ("c", jnp.sin))]
  report = harness.Report("rounds", 3, str(tmp_path))
  rates = report.measure_rounds(rows, rounds=2)
  assert seen == ["a", "b", "c", "a", "c", "c", "a"]  # b failed when prepared
  assert [r.impl for r in report.rows] == ["a", "b", "c"]
  assert rates[1] is None and "ValueError: no such kernel" in report.rows[1].note
  assert rates[0] > 0 and report.rows[0].max_abs_err == pytest.approx(1.718, abs=1e-3)
  assert "timed in 2 rounds of 10" in report.markdown() and report.rows[0].rounds == 2
  # A row of one round beside them (as a merge of two runs): the rows in rounds say so.
  report.measure(op="op", impl="d", shape=(4,), dtype="float32", mode="fwd", fn=jnp.exp,
                 arg_sets=[(x,)], nbytes=16)
  table = report.markdown()
  assert "some rows timed in rounds" in table and table.count("| timed in 2 rounds |") == 2
  with pytest.raises(TypeError, match="unknown \\[.flop.\\], missing \\[\\]"):
    report.measure(op="op", impl="d", shape=(4,), dtype="float32", mode="fwd",
                   fn=jnp.exp, arg_sets=[(x,)], flop=1)
  with pytest.raises(TypeError, match="missing \\['fn'\\]"):
    report.measure(op="op", impl="d", shape=(4,), dtype="float32", mode="fwd",
                   arg_sets=[(x,)], nbytes=16)
  with pytest.raises(ValueError, match="BENCH_ROUNDS"):
    report.measure_rounds(rows, rounds=0)


def test_timer_rounds_share_the_iterations_out(monkeypatch):
  # On a GPU (stood in for here) each round of a two-round run (`measure_rounds`) times
  # 10 iterations and two end-to-end runs, each of ITERATIONS calls all the same.
  import jax.numpy as jnp
  harness = _benchmark_module("harness")
  walls, cupti = [], iter([[2.0] * 10, RuntimeError("dropped records"), [2.0] * 20])

  def cupti_times(run_all, arg_sets, iterations):
    result = next(cupti)
    if isinstance(result, Exception):
      raise result
    return result

  monkeypatch.setattr(harness.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(harness, "_pipelined_wall_us",
                      lambda jitted, arg_sets, calls: walls.append(calls) or 5.0)
  monkeypatch.setattr(harness, "_cupti_times", cupti_times)
  monkeypatch.setattr(harness, "_trace_times", lambda run_all, arg_sets, n: [4.0] * n)
  timer = harness.Timer(jnp.exp, [(jnp.ones(3),)])
  timer.run_round(10, wall_runs=2)
  assert walls == [20, 20] and timer.result == (2.0, 5.0, "cupti")
  timer.run_round(10, wall_runs=2)  # CUPTI fails: the trace's times, and both names
  assert len(timer.device) == 20 and timer.result == (3.0, 5.0, "cupti+jax.profiler")
  walls.clear()
  harness.time_call(jnp.exp, [(jnp.ones(3),)])  # one round of everything
  assert walls == [20, 20, 20]


def test_attn_rows_keeps_the_named_rows(monkeypatch):
  bench_attention = _benchmark_module("bench_attention")
  impls = {"jaxsoftmax mosaic_gpu": 1, "cudnn": 2, "fa3": 3}
  monkeypatch.setenv("ATTN_ROWS", "jaxsoftmax mosaic_gpu,fa3")
  assert bench_attention.kept(impls) == {"jaxsoftmax mosaic_gpu": 1, "fa3": 3}
  # Timed in the order named, a name not among the rows left out.
  monkeypatch.setenv("ATTN_ROWS", "fa3,tokamax mosaic,jaxsoftmax mosaic_gpu,fa3")
  assert list(bench_attention.kept(impls).items()) == [("fa3", 3), ("jaxsoftmax mosaic_gpu", 1)]
  monkeypatch.delenv("ATTN_ROWS")
  assert list(bench_attention.kept(impls)) == list(impls)
  monkeypatch.setenv("BWD_ROWS", "cudnn")  # bench_attention_backward's rows
  assert bench_attention.kept(impls, "BWD_ROWS") == {"cudnn": 2}


def test_hopper_fwd_schedules_add_rows_of_ours(monkeypatch):
  # Each schedule a row of ours whose forward takes the head dim's default tiles with
  # the flags set (head dim 128 causal: 128-key blocks and the overlapped softmax).
  bench_attention = _benchmark_module("bench_attention")
  monkeypatch.setenv("HOPPER_FWD_SCHEDULES", "dynamic,persistent+stages3,static")
  impls = bench_attention.implementations(16, 16, 128, True)
  rows = {name: impl for name, (impl, _) in impls.items() if name.startswith("jaxsoftmax")}
  default = bench_attention.HopperBlockSizes.default(128, True)
  assert rows["jaxsoftmax mosaic_gpu dynamic"].keywords["block_sizes"] == dataclasses.replace(
      default, persistent=True, dynamic_schedule=True)
  assert rows["jaxsoftmax mosaic_gpu persistent+stages3"].keywords["block_sizes"] == (
      dataclasses.replace(default, persistent=True, num_stages=3))
  # "static": the tiles of a call of few (batch row, head) pairs, which claim no items.
  assert rows["jaxsoftmax mosaic_gpu static"].keywords["block_sizes"] == default
  assert not default.dynamic_schedule
  assert "block_sizes" not in rows["jaxsoftmax mosaic_gpu"].keywords
  monkeypatch.setenv("HOPPER_FWD_SCHEDULES", "dynamic+fast")
  with pytest.raises(ValueError, match=r"unknown forward flags \['fast'\]"):
    bench_attention.implementations(16, 16, 128, True)


def test_ncu_stalls_reads_a_source_table(tmp_path):
  # A loop body of two instructions run 1000 times, a barrier's retry loop of one run
  # 1500 times, and a prologue run once: the step count is the body's, and its shares are
  # the body's samples alone.
  header = ["Address", "Source", "Warp Stall Sampling (All Samples)",
            "Instructions Executed", "stall_barrier", "stall_long_sb",
            "stall_long_sb (Not Issued)"]
  rows = [["0x0", "  MOV R1, R2", "1", "1", "0", "1", "0"],
          ["0x10", "  HGMMA.64x64x16 R0, gdesc[UR4], R0", "30", "1000", "30", "0", "0"],
          ["0x20", "  FADD R3, R3, R4", "10", "1000", "0", "10", "0"],
          ["0x30", "  @!P0 BRA 0x30", "60", "1500", "0", "60", "0"]]
  path = tmp_path / "k.sass.log"
  path.write_text('"Kernel Name","k",\n' + "\n".join(
      ",".join(f'"{x}"' for x in r) for r in [header, *rows]) + "\n")
  out = _run("benchmarks/ncu_stalls.py", str(path), "--top", "2").stdout
  assert "step count 1 K (warp-steps); the per-step code: 2 instructions, 40% of the " \
      "samples, 2 executed a warp-step" in out
  assert "per-step code: barrier 75.0%, long_sb 25.0%" in out
  assert "whole kernel: long_sb 70.3%, barrier 29.7%" in out
  assert out.splitlines()[-2].split()[:2] == ["3", "59.4%"]  # the retry loop first


def test_resources_offline_finds_the_innermost_wgmma_loops():
  # nvdisasm's text: an outer loop holding an inner one; only the inner, which issues
  # HGMMA, is reported, with its instruction counts (a spill's reload among them).
  resources_offline = _benchmark_module("resources_offline")
  sass = """
  .L_x_1:
        /*0000*/   IADD3 R1, R1, 0x1, RZ ;
  .L_x_2:
        /*0010*/   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/   MUFU.EX2 R2, R3 ;
        /*0030*/   SYNCS.ARRIVE.TRANS64 RZ, [UR8], RZ ;
        /*0038*/   LDL R4, [R1+0x10] ;
        /*0040*/   @P0 BRA `(.L_x_2) ;
        /*0050*/   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0060*/   @P1 BRA `(.L_x_1) ;
        /*0070*/   BRA `(.L_x_3) ;
  .L_x_3:
        /*0080*/   EXIT ;
"""
  assert resources_offline.innermost_wgmma_loops(sass) == [(5, 1, 1, 1, 1, 0)]


def test_launch_order_schedules_the_backward_ctas():
  # Two SMs and CTAs of 5, 3, 3 and 1 steps (+1 each) in that order: the first two start
  # at once, the third on the SM free at 4, the fourth on the one free at 6: finish 8.
  launch_order = _benchmark_module("launch_order")
  assert launch_order.finish([5, 3, 3, 1], sms=2, overhead=1) == 8
  # Causal 1x512, 2 heads: tiles of 128 keys see 8, 6, 4 and 2 query blocks of 64, in
  # the launch order the batch rows fastest, then the key tiles, the K/V head slowest.
  assert launch_order.cta_steps(1, 512, 2, 2) == [8, 6, 4, 2, 8, 6, 4, 2]
  assert launch_order.cta_steps(1, 512, 4, 2)[:2] == [16, 12]  # two query heads a CTA
  # With l2_sections on 2 SMs a section is one head (4 CTAs make 0.9 of the wave); the
  # sections go on the grid's last axis, so they alternate.
  blocks = dataclasses.replace(launch_order.mosaic_backward.BLOCKS, l2_sections=True)
  order = launch_order.ctas(1, 512, 2, 2, blocks=blocks, sms=2)
  assert [(c.heads, c.lo) for c in order[:3]] == [((0,), 0), ((1,), 0), ((0,), 2)]
  # L2: with room for everything each block is missed once, its first time; with none,
  # always. Head 0's 20 steps (8 + 6 + 4 + 2) read its 8 query blocks: 8 misses.
  one_head = launch_order.ctas(1, 512, 2, 2, sms=2)[:4]
  assert {c.heads for c in one_head} == {(0,)}
  assert launch_order.l2_hits(one_head, 2, 2**30, 64) == 1 - 8 / 20
  assert launch_order.l2_hits(one_head, 2, 0, 64) == 0
  # The forward, causal 1x512 with 2 heads on 3 SMs: 4 tiles of 4, 3, 2 and 1 key blocks
  # a head, 20 in all, 20 / 3 an even share. Claimed in item_at's order, a head at a
  # time (4, 3, 2, 1, 4, 3, 2, 1), the SMs end at 6, 7 and 7; the fixed share's snake
  # gives 4 + 2 + 1, 4 + 2 + 1 and 3 + 3. The fixed share's first wave walks both heads,
  # the claimed items' head 0 alone.
  assert launch_order.forward_orders(1, 512, 2, 3) == (7 / (20 / 3), 7 / (20 / 3), 2, 1)
  work = launch_order.mosaic_forward._Work(1, 2, 4, True, 3)
  assert launch_order.heads_fastest(work)[:3] == [(0, 0, 3), (0, 1, 3), (0, 0, 2)]
  # Items of 4, 1, 3 and 1 steps on two SMs. Each claimed as its SM frees up: the second
  # SM takes the 3 at 1 and the last 1 at 4, finish 5. Each CTA claiming its next item as
  # it starts one: the first holds the 3 from the start, finish 4 + 3 = 7.
  assert launch_order.finish([4, 1, 3, 1], sms=2, overhead=0) == 5
  assert launch_order.finish_claiming_ahead([4, 1, 3, 1], sms=2) == 7
  assert launch_order.finish_claiming_ahead([2, 2], sms=4) == 2  # fewer items than SMs
  # The forward's K and V through L2: two items of one head, 3 and 2 key blocks, on two
  # SMs read blocks 0 and 1 together (one misses, one hits) and block 2 alone: 2 hits
  # of 5, in 3 ticks; one SM walking two heads' items, 5 ticks, misses every block.
  assert launch_order.forward_l2_hits([(0, 0, 2), (0, 0, 1)], 2, 2, 2, 2**30) == (2 / 5, 3)
  assert launch_order.forward_l2_hits([(0, 0, 2), (0, 1, 1)], 2, 2, 1, 2**30) == (0, 5)
  assert launch_order.forward_l2_hits([(0, 0, 2), (0, 0, 1)], 2, 2, 2, 0) == (0, 3)
  # The dQ kernel, causal 1x512 with 2 heads: tiles of 128 queries walk 2, 4, 6 and 8
  # key blocks of 64; launched from the last tile, each head's longest first.
  assert launch_order.dq_steps(1, 512, 2, longest_first=False) == [2, 4, 6, 8] * 2
  assert launch_order.dq_steps(2, 512, 1, longest_first=True) == [8, 8, 6, 6, 4, 4, 2, 2]


def test_tune_linear_cross_entropy_smoke(tmp_path):
  rows = _smoke_rows(tmp_path, "tune_linear_cross_entropy", "tune_linear_cross_entropy")
  # XLA's product alone, then each tiling of the forward, right against float64.
  assert rows[0]["impl"] == "x @ w (product alone)"
  tiles = rows[1:]
  assert len(tiles) == 2 and all(r["median_us"] > 0 and r["max_rel_err"] < 1e-4
                                 for r in tiles)


def test_run_gpu_pack_only_leaves_the_archive_alone(tmp_path):
  # PACK_ONLY=1: under $OUT only run.tgz and summary.log, the stage's log inside the
  # archive (a pytest stage, which runs anywhere).
  script = os.path.join(ROOT, "benchmarks", "run_gpu.sh")
  env = dict(os.environ, STAGES="pytest", OUT=str(tmp_path), PACK_ONLY="1",
             PYTEST_ARGS="tests/test_benchmarks.py -k kernel_timeline -p no:xdist",
             PYTHON=sys.executable)
  subprocess.run(["bash", script], capture_output=True, text=True, env=env, cwd=ROOT,
                 check=True, timeout=300)
  assert sorted(os.listdir(tmp_path)) == ["run.tgz", "summary.log"]
  with tarfile.open(tmp_path / "run.tgz") as archive:
    names = {os.path.basename(n) for n in archive.getnames()}
  assert {"env.log", "pytest.log", "summary.log"} <= names
  with open(tmp_path / "summary.log") as f:
    assert "1 passed" in f.read()


def test_run_gpu_baseline_is_imported_first(tmp_path):
  # BASELINE=folder: the scripts import that folder's jaxsoftmax (an A/B against older
  # code in one call), and env.log says which they import; without it, the repo's.
  script = os.path.join(ROOT, "benchmarks", "run_gpu.sh")
  (tmp_path / "base" / "jaxsoftmax").mkdir(parents=True)
  (tmp_path / "base" / "jaxsoftmax" / "__init__.py").write_text("")
  for baseline, imported in ((str(tmp_path / "base"), str(tmp_path / "base" / "jaxsoftmax")),
                             (None, os.path.join(ROOT, "jaxsoftmax"))):
    out = tmp_path / ("with" if baseline else "without")
    env = dict(os.environ, STAGES=" ", OUT=str(out), PYTHON=sys.executable)
    env.pop("BASELINE", None)  # the case without it must not inherit the caller's
    if baseline:
      env["BASELINE"] = baseline
    subprocess.run(["bash", script], capture_output=True, text=True, env=env, cwd=ROOT,
                   check=True, timeout=120)
    assert f"jaxsoftmax from {imported}\n" in (out / "run" / "env.log").read_text()


def test_run_gpu_lists_and_checks_its_stages(tmp_path):
  # --help prints the stages; a stage name that does not exist stops the run before any
  # stage starts (nothing written under $OUT); every stage the case statement handles is
  # one the check knows.
  script = os.path.join(ROOT, "benchmarks", "run_gpu.sh")
  shown = subprocess.run(["bash", script, "--help"], capture_output=True, text=True,
                         check=True).stdout
  assert "command-buffers" in shown and "set -uo" not in shown
  env = dict(os.environ, STAGES="tests no-such-stage", OUT=str(tmp_path))
  bad = subprocess.run(["bash", script], capture_output=True, text=True, env=env, cwd=ROOT)
  assert bad.returncode == 2 and "unknown stage 'no-such-stage'" in bad.stderr
  assert not os.listdir(tmp_path)
  with open(script) as f:
    text = f.read()
  handled = set(re.findall(r"^    ([a-z0-9-]+)\)$", text, re.M))
  known = set(re.search(r'^known="([^"]*)"', text, re.M).group(1).split())
  assert handled == known
  # --help names every stage (as itself, not inside a longer stage's name).
  assert not [s for s in known if not re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", shown)]


def test_tests_done_reads_pytest_and_times_logs(tmp_path):
  # JAXSOFTMAX_TESTS_DONE (conftest.py): what a cut GPU run finished is left out of the
  # next; a failure, or a setup that passed before its call failed, is not.
  from conftest import tests_done
  verbose, times = tmp_path / "verbose.log", tmp_path / "times.log"
  verbose.write_text("[gw0] [ 10%] PASSED tests/t.py::a[x-1]\n"
                     "tests/t.py::b SKIPPED (needs a GPU)\n"
                     "[gw1] [ 20%] FAILED tests/t.py::c\n"
                     "FAILED tests/t.py::g - AssertionError: 3 passed, 1 off\n"
                     "collected 7 items\n")
  times.write_text("     3.0 s setup passed  tests/t.py::d\n"
                   "     9.0 s call  failed  tests/t.py::d\n"
                   "     0.1 s setup passed  tests/t.py::e\n"
                   "     5.0 s call  passed  tests/t.py::e\n"
                   "     0.0 s setup skipped tests/t.py::f\n")
  assert tests_done(f"{verbose},{times}") == {"tests/t.py::a[x-1]", "tests/t.py::b",
                                              "tests/t.py::e", "tests/t.py::f"}
  assert tests_done("") == set()
