"""Shared benchmark machinery: device-side timing, ceilings, errors, reports.

Timing: every measurement is the median over iterations of the summed durations of the
GPU kernels one call launches, read with CUPTI (`jax.experimental.mosaic.gpu.profiler`)
or, where CUPTI is unavailable or BENCH_TIMER=trace asks (CUPTI's C++ side aborted the
process on 2026-12-05, "activity records were dropped", at the Hopper kernels behind a
key mask's lax.switch), from a `jax.profiler` trace. Each iteration calls the
function on several input sets in turn when one set fits in L2 (inputs are rotated past
60 MB), after a warm-up that compiles. Beside it, the end-to-end time per call: wall
clock over ITERATIONS calls issued back to back (pipelined, as a training step issues
them), the median of three such runs, which counts the gaps between a call's kernels
that summed durations leave out. Rows of one shape may be timed in interleaved rounds
(BENCH_ROUNDS, `Report.measure_rounds`), A B C then C B A, so that none is always timed
after the others.

Ceilings: a Pallas copy kernel (read + write) and a Pallas read kernel (read only), run
in the same process on the same shapes, give the bandwidth the other rows are compared to.

Clocks: while a row is timed, a thread samples the GPU's SM clock through NVML
(`ClockSampler`); where the GPU lowered it (power cap, heat), the row's note says so, since
a row measured after a long one may then run at a lower clock than the rows before it
(the case for the rounds above).

Errors: max abs error against a float64 truth computed on the device, and the normwise
relative error max|out - truth| / max|truth| (elementwise ratios are meaningless for
probabilities that underflow).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import glob
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl

L2_BYTES = 60 * 2**20
ITERATIONS = 20
WARMUP = 3


def lower_as_if_on_an_h200():
  """Pallas' Triton lowering asks the device for its compute capability: from here on
  it answers as an H200's, so that the offline tools lower for CUDA without a GPU (as
  tests/conftest.py's ``as_if_on_an_h200``; the module that answers is Pallas' own up
  to JAX 0.12.0, JAX's from 0.12.1)."""
  try:
    from jax._src import gpu_info
  except ImportError:
    from jax._src.pallas.triton import gpu_info
  if hasattr(gpu_info, "GpuVersion"):
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(
        gpu_info.GpuVersion.H200)


# --- timing ----------------------------------------------------------------------------


def rotations(nbytes: int) -> int:
  """Input sets to rotate so that consecutive calls never find their inputs in L2. One
  without a GPU: a smoke run calls each function on the first set only (`time_call`),
  and its tiny shapes would otherwise make thousands of sets (1639 of a 16x300 bfloat16
  problem's), each made, and some run through a forward, for nothing."""
  if jax.default_backend() != "gpu":
    return 1
  return max(1, math.ceil(2 * L2_BYTES / max(nbytes, 1)))


def _cupti_times(run_all, arg_sets, iterations):
  """Device time (us) per call of each of ``iterations`` calls of ``run_all`` (jitted:
  every input set once), read by CUPTI."""
  from jax.experimental.mosaic.gpu import profiler
  _, per_iteration = profiler.measure(run_all, iterations=iterations)(arg_sets)
  if per_iteration is None:
    raise RuntimeError("CUPTI saw no kernels")
  return [t * 1e3 / len(arg_sets) for t in per_iteration]  # ms -> us per call


def _profile(run: Callable[[], object]):
  """The `jax.profiler` trace (ProfileData) of ``run()``, waited for."""
  from jax.profiler import ProfileData
  with tempfile.TemporaryDirectory() as logdir:
    jax.profiler.start_trace(logdir)
    jax.block_until_ready(run())
    jax.profiler.stop_trace()
    [path] = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
    return ProfileData.from_file(path)


def _trace_times(run_all, arg_sets, iterations):
  """Kernel time per call from a jax.profiler trace (device planes, stream lines)."""
  jax.block_until_ready(run_all(arg_sets))
  profile = _profile(lambda: [jax.block_until_ready(run_all(arg_sets))
                              for _ in range(iterations)])
  events = sorted(
      (event.start_ns, event.duration_ns)
      for plane in profile.planes if plane.name.startswith("/device:GPU")
      for line in plane.lines if line.name.startswith("Stream")
      for event in line.events)
  if not events or len(events) % iterations:
    raise RuntimeError(f"trace has {len(events)} kernel events for {iterations} iterations")
  per = len(events) // iterations
  return [sum(d for _, d in events[i * per:(i + 1) * per]) / 1e3 / len(arg_sets)
          for i in range(iterations)]


def trace_planes(fn, args, calls: int = 1) -> dict:
  """A `jax.profiler` trace of ``calls`` back-to-back calls (after one untraced): plane
  -> line -> [(event name, start us, duration us)], every device and host thread."""
  jax.block_until_ready(fn(*args))
  profile = _profile(lambda: [fn(*args) for _ in range(calls)])
  return {plane.name: {line.name: [(event.name, event.start_ns / 1e3,
                                    event.duration_ns / 1e3) for event in line.events]
                       for line in plane.lines} for plane in profile.planes}


def device_kernels(planes: dict) -> list[tuple[str, float, float]]:
  """The kernels of a `trace_planes` trace on its first device, by start: (name, start
  us, duration us); empty off a GPU (the trace has no device plane there)."""
  device = sorted(p for p in planes if p.startswith("/device:"))
  if not device:
    return []
  return sorted(((name, start, duration) for line, events in planes[device[0]].items()
                 if line.startswith("Stream") for name, start, duration in events),
                key=lambda k: k[1])


def kernel_groups(kernels, calls: int) -> list[tuple[str, int, float]]:
  """`device_kernels` grouped by name: (name, launches per call, us per call), most time
  first."""
  groups = collections.defaultdict(lambda: [0, 0.0])
  for name, _, duration in kernels:
    groups[name][0] += 1
    groups[name][1] += duration
  return sorted(((name, n // calls, us / calls) for name, (n, us) in groups.items()),
                key=lambda g: -g[2])


def kernel_table(groups, total: float, per: str) -> list[str]:
  """`kernel_groups` as the lines of a Markdown table: launches and microseconds per
  ``per`` (a call, a step) and each kernel's share of ``total``, their sum."""
  return ([f"| kernel | launches | us per {per} | share |", "|---|---|---|---|"]
          + [f"| `{name[:100]}` | {n} | {us:.1f} | {us / max(total, 1e-9):.1%} |"
             for name, n, us in groups])


def span_and_gaps(kernels, calls: int) -> tuple[float, list[float]]:
  """The device's span per call of `device_kernels` (first kernel's start to last
  kernel's end, over the calls; NaN without kernels) and its idle gaps (us), largest
  first."""
  if not kernels:
    return float("nan"), []
  gaps, end = [], None
  for _, start, duration in kernels:
    if end is not None and start > end:
      gaps.append(start - end)
    end = start + duration if end is None else max(end, start + duration)
  return (end - kernels[0][1]) / calls, sorted(gaps, reverse=True)


def kernel_section(title: str, kernels, calls: int) -> list[str]:
  """The Markdown lines of one traced call (`device_kernels` of ``calls`` calls): the
  device's span per call, its kernels' sum and largest idle gaps, and `kernel_table`."""
  span, gaps = span_and_gaps(kernels, calls)
  groups = kernel_groups(kernels, calls)
  busy = sum(us for _, _, us in groups)
  return ([title, "", f"Span per call {span:.1f} us, kernels {busy:.1f} us; largest gaps "
           "(us): " + ", ".join(f"{g:.1f}" for g in gaps[:4]), ""]
          + kernel_table(groups, busy, "call") + [""])


def _pipelined_wall_us(jitted, arg_sets, calls: int) -> float:
  """Wall-clock time per call of ``calls`` calls issued back to back (us)."""
  start = time.perf_counter()
  outs = [jitted(*arg_sets[i % len(arg_sets)]) for i in range(calls)]
  jax.block_until_ready(outs)
  return (time.perf_counter() - start) * 1e6 / calls


class Timer:
  """Times ``fn`` on ``arg_sets`` (input sets the iterations rotate through: see
  `rotations`) in one or more rounds, which `Report.measure_rounds` interleaves with
  other rows' rounds. Each round: a warm-up, end-to-end (pipelined wall-clock) runs of
  ITERATIONS calls, and device-timed calls. The functions are jitted once, here, so
  that a later round compiles nothing.

  Without a GPU (a smoke run of the scripts, which checks them and their results, not
  speed: its interpreted kernels take up to seconds a call) a round is one call's wall
  time, both device and end to end, timer "wall".
  """

  def __init__(self, fn: Callable, arg_sets: Sequence[tuple]):
    self.arg_sets = arg_sets
    self.jitted = jax.jit(fn)
    self.run_all = jax.jit(lambda sets: [fn(*args) for args in sets])
    self.device, self.walls, self.timer = [], [], None

  def run_round(self, iterations: int = ITERATIONS, wall_runs: int = 3):
    """Adds a round's samples: ``iterations`` device-timed calls and ``wall_runs``
    end-to-end runs."""
    first = self.arg_sets[0]
    if jax.default_backend() != "gpu":
      start = time.perf_counter()
      jax.block_until_ready(self.jitted(*first))
      wall = (time.perf_counter() - start) * 1e6
      self.device.append(wall)
      self.walls.append(wall)
      self.timer = "wall"
      return
    for _ in range(WARMUP):
      jax.block_until_ready(self.jitted(*first))
    # Each end-to-end run keeps ITERATIONS calls whatever the round's iterations, since
    # a shorter one would spread the pipeline's fill over fewer calls.
    self.walls += [_pipelined_wall_us(self.jitted, self.arg_sets, ITERATIONS)
                   for _ in range(wall_runs)]
    try:
      if os.environ.get("BENCH_TIMER") == "trace":
        raise RuntimeError("BENCH_TIMER=trace")
      device, timer = _cupti_times(self.run_all, self.arg_sets, iterations), "cupti"
    except Exception as cupti_error:  # noqa: BLE001 - fall back, and say why below
      try:
        device, timer = _trace_times(self.run_all, self.arg_sets, iterations), "jax.profiler"
      except Exception as trace_error:  # noqa: BLE001
        raise RuntimeError(f"no device timer: cupti: {cupti_error}; trace: {trace_error}")
    self.device += device
    # Both names where one round's CUPTI failed and another's did not.
    self.timer = timer if self.timer in (None, timer) else f"{self.timer}+{timer}"

  @property
  def result(self) -> tuple[float, float, str]:
    """Median device time (us) per call over every round's samples, median end-to-end
    time (us) per call, and the timer used."""
    return statistics.median(self.device), statistics.median(self.walls), self.timer


def time_call(fn: Callable, arg_sets: Sequence[tuple]):
  """Median device time (us) per call, end-to-end (pipelined wall-clock) time (us) per
  call, and the timer used: one `Timer` round of ITERATIONS calls."""
  timer = Timer(fn, arg_sets)
  timer.run_round()
  return timer.result


# --- the GPU's clocks ------------------------------------------------------------------

# NVML's clock event reasons (nvml.h, nvmlClocksEventReason*) that lower the SM clock
# under load; GPU_IDLE marks a sample taken between kernels.
GPU_IDLE = 0x1
SLOWDOWNS = {0x4: "power cap", 0x8: "hardware slowdown", 0x20: "thermal (software)",
             0x40: "thermal (hardware)", 0x80: "power brake"}


@functools.cache
def _nvml_reader() -> Callable[[], tuple[int, int]]:
  """() -> (SM clock MHz, clock event reasons) of the first GPU NVML lists (the one
  GPU of the single-GPU machines), through the driver's libnvidia-ml; raises OSError or
  RuntimeError where there is none (a machine without a GPU)."""
  import ctypes
  nvml = ctypes.CDLL("libnvidia-ml.so.1")
  if nvml.nvmlInit_v2() != 0:
    raise RuntimeError("nvmlInit failed")
  handle = ctypes.c_void_p()
  if nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) != 0:
    raise RuntimeError("NVML has no GPU 0")
  # NVML's newer name for the call; older drivers have only the "throttle" one.
  reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
      nvml.nvmlDeviceGetCurrentClocksThrottleReasons
  clock, reasons = ctypes.c_uint(), ctypes.c_ulonglong()

  def read():
    if (nvml.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(clock))  # NVML_CLOCK_SM
        or reasons_fn(handle, ctypes.byref(reasons))):
      raise RuntimeError("NVML could not read the clock")
    return clock.value, reasons.value
  return read


class ClockSampler:
  """The SM clock while a block runs, sampled from a thread every ``period`` seconds:
  whether the GPU lowered it (a long row can heat it, or reach its power cap, and then
  the rows after it run at a lower clock than the ones before: docs/kernels.md, where
  the Hopper attention stands). ``read``: () -> (MHz, NVML's event reasons), NVML's by
  default; where it cannot be read (no GPU), `result` is None.

      with ClockSampler() as clocks:
        ...
      clocks.result  # (median MHz, lowest MHz, slowdowns seen) over the busy samples

  It may be entered again (a row's later rounds, `Report.measure_rounds`): the samples
  add up, and ``result`` covers them all.
  """

  def __init__(self, period: float = 0.005, read: Callable[[], tuple[int, int]] | None = None):
    self.period, self.samples, self.result = period, [], None
    try:
      self._read = read or _nvml_reader()
    except (OSError, RuntimeError, AttributeError):
      self._read = None

  def __enter__(self):
    import threading
    self._stop = threading.Event()
    self._thread = None
    if self._read is not None:
      self._thread = threading.Thread(target=self._run, daemon=True)
      self._thread.start()
    return self

  def _run(self):
    while not self._stop.is_set():
      try:
        self.samples.append(self._read())
      except RuntimeError:
        return
      self._stop.wait(self.period)

  def __exit__(self, *exc):
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    busy = [(mhz, reasons) for mhz, reasons in self.samples if not reasons & GPU_IDLE]
    if busy:
      seen = ", ".join(name for bit, name in SLOWDOWNS.items()
                       if any(reasons & bit for _, reasons in busy))
      clocks = [mhz for mhz, _ in busy]
      self.result = (statistics.median(clocks), min(clocks), seen)
    return False

# --- bandwidth ceilings ----------------------------------------------------------------

_CEILING_BLOCK = 16384


def _flat_blocks(n: int):
  return pl.cdiv(n, _CEILING_BLOCK)


def copy_kernel(x: jax.Array) -> jax.Array:
  """A plain Pallas copy: the read + write ceiling."""
  flat = x.reshape(-1)
  n = flat.size

  def kernel(x_ref, y_ref):
    idx = pl.program_id(0) * _CEILING_BLOCK + jnp.arange(_CEILING_BLOCK, dtype=jnp.int32)
    ok = idx < n
    pallas.store(y_ref, pallas.load(x_ref, mask=ok, other=0), mask=ok)

  spec = pl.BlockSpec((_CEILING_BLOCK,), lambda i: (i,))
  return pallas.pallas_call(
      kernel, name="ceiling_copy", grid=(_flat_blocks(n),), in_specs=[spec],
      out_specs=spec, out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
      num_warps=8, num_stages=1, interpret=pallas.resolve_interpret(None))(flat).reshape(x.shape)


def read_kernel(x: jax.Array) -> jax.Array:
  """A plain Pallas read: one float32 sum per block, the read ceiling."""
  flat = x.reshape(-1)
  n = flat.size

  def kernel(x_ref, s_ref):
    idx = pl.program_id(0) * _CEILING_BLOCK + jnp.arange(_CEILING_BLOCK, dtype=jnp.int32)
    v = pallas.load(x_ref, mask=idx < n, other=0).astype(jnp.float32)
    pallas.store(s_ref, jnp.sum(v, keepdims=True))

  return pallas.pallas_call(
      kernel, name="ceiling_read", grid=(_flat_blocks(n),),
      in_specs=[pl.BlockSpec((_CEILING_BLOCK,), lambda i: (i,))],
      out_specs=pl.BlockSpec((1,), lambda i: (i,)),
      out_shape=jax.ShapeDtypeStruct((_flat_blocks(n),), jnp.float32),
      num_warps=8, num_stages=1, interpret=pallas.resolve_interpret(None))(flat)


# --- errors ----------------------------------------------------------------------------


def float64_truth(fn: Callable, *args):
  """``fn`` on float64 copies of the floating ``args`` (None passes), on the device."""
  with jax.enable_x64(True):
    cast = [a.astype(jnp.float64) if a is not None and jnp.issubdtype(a.dtype, jnp.floating)
            else a for a in args]
    return jax.block_until_ready(jax.jit(fn)(*cast))


def pullbacks(fn: Callable, primal_sets: Sequence[tuple]):
  """The backward alone, as a model pays it: the forward runs once per input set, here,
  and only the pullback is timed, from the residuals the forward saved. Timing
  ``jax.vjp`` and its pullback in one jit instead lets XLA fuse the forward's passes into
  the backward's (its own ops; a `custom_vjp` cannot), which a model, with other layers
  between the two, does not allow.

  Returns ``(call, residual_sets)``: ``call(residuals, *cotangents)`` applies the pullback
  of the input set whose residuals are given. The pullbacks of equal shapes share one
  structure; only their residual arrays differ, so one compiled call serves all sets.
  """
  vjps = [jax.vjp(fn, *primals)[1] for primals in primal_sets]
  structure = jax.tree.structure(vjps[0])

  def call(residuals, *cotangents):
    return jax.tree.unflatten(structure, residuals)(*cotangents)
  return call, [jax.tree.leaves(v) for v in vjps]


def failure_note(error: Exception) -> str:
  """The note of a row whose measurement failed: the error's type and first line."""
  return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def errors(out, truth) -> tuple[float, float]:
  """(max abs error, normwise relative error) over the finite truth; NaN if ``out`` has
  NaN or infinity where the truth is finite. Pytrees (e.g. output and gradient) give the
  largest of their leaves' errors."""
  pairs = list(zip(jax.tree.leaves(out), jax.tree.leaves(truth), strict=True))
  if len(pairs) != 1:
    errs = np.array([errors(o, t) for o, t in pairs])
    return tuple(float("nan") if np.isnan(col).any() else float(col.max()) for col in errs.T)
  out, truth = pairs[0]
  with jax.enable_x64(True):
    out = jnp.asarray(out).astype(jnp.float64)
    truth = jnp.asarray(truth, jnp.float64)
    finite = jnp.isfinite(truth)
    bad = jnp.any(finite & ~jnp.isfinite(out))
    err = jnp.max(jnp.where(finite, jnp.abs(out - truth), 0))
    scale = jnp.max(jnp.where(finite, jnp.abs(truth), 0))
    if bool(bad):
      return float("nan"), float("nan")
    return float(err), float(err / jnp.maximum(scale, 1e-300))


# --- results ---------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
  op: str
  impl: str
  shape: str
  dtype: str
  mode: str
  max_abs_err: float | None
  max_rel_err: float | None
  median_us: float | None
  wall_us: float | None
  gbps: float | None
  pct_ceiling: float | None
  ceiling: str
  timer: str
  note: str = ""
  tflops: float | None = None
  peak_mib: float | None = None
  # The SM clock while the row was timed (`ClockSampler`): median and lowest MHz, and
  # the slowdowns NVML gave as reasons ("power cap", ...); None off a GPU.
  sm_mhz: float | None = None
  sm_mhz_min: float | None = None
  slowdowns: str = ""
  # The interleaved rounds the row was timed in (`Report.measure_rounds`).
  rounds: int = 1

  @property
  def clock_note(self) -> str:
    """The note's words on the clock, where the GPU lowered it during the timing."""
    if not self.slowdowns:
      return ""
    return f"SM clock {self.sm_mhz:.0f} MHz (lowest {self.sm_mhz_min:.0f}): {self.slowdowns}"

  @property
  def tflops_e2e(self) -> float | None:
    """TFLOP/s by the end-to-end (wall) time instead of the device time."""
    return None if self.tflops is None else self.tflops * self.median_us / self.wall_us


def peak_memory_mib(fn, *args) -> float:
  """Device memory one call of ``fn`` needs besides its inputs: XLA's buffer assignment
  (temporaries + outputs) of the compiled program, in MiB."""
  stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  return (stats.temp_size_in_bytes + stats.output_size_in_bytes) / 2**20


ATTENTION_FLOPS = ("2·B·N·T·S·(H + Hv), 4·B·N·T·S·H where the value head dim Hv = H (halved when "
                   "causal; 3.5x for forward + backward)")


class _Pending:
  """One row of `Report.measure_rounds` between its rounds: its errors and peak memory,
  its `Timer` and `ClockSampler`, or the error that stopped it."""

  REQUIRED = {"op", "impl", "shape", "dtype", "mode", "fn", "arg_sets"}
  KEYS = REQUIRED | {"nbytes", "flops", "truth", "compare", "ceiling_gbps", "ceiling",
                     "note", "context"}

  def __init__(self, row: dict):
    unknown, missing = set(row) - self.KEYS, self.REQUIRED - set(row)
    if unknown or missing or ("nbytes" in row) == ("flops" in row):
      raise TypeError(f"a row takes {sorted(self.REQUIRED)}, nbytes or flops (one), and "
                      f"optionally {sorted(self.KEYS - self.REQUIRED - {'nbytes', 'flops'})}"
                      f"; got unknown {sorted(unknown)}, missing {sorted(missing)}")
    self.row = dict(row)
    self.context = self.row.pop("context", contextlib.nullcontext)
    self.err, self.peak, self.failure = (None, None), None, None
    self.timer, self.clocks = None, ClockSampler()

  def prepare(self):
    """Compiles the row's function and runs it once: its errors and peak memory."""
    row = self.row
    fn, first = row["fn"], row["arg_sets"][0]
    try:
      with self.context():
        self.timer = Timer(fn, row["arg_sets"])
        out = jax.block_until_ready(self.timer.jitted(*first))
        if row.get("truth") is not None:
          compare = row.get("compare")
          self.err = errors(compare(out) if compare else out, row["truth"])
        del out
        if row.get("flops") is not None:
          self.peak = peak_memory_mib(fn, *first)
    except Exception as e:  # noqa: BLE001 - a peer that fails is a result, not a crash
      self.failure = e

  def time_round(self, iterations: int, wall_runs: int):
    """One round of the row's timing (`Timer.run_round`), the clock sampled; a failure
    ends the row."""
    if self.failure is not None:
      return
    try:
      with self.context(), self.clocks:
        self.timer.run_round(iterations, wall_runs)
    except Exception as e:  # noqa: BLE001
      self.failure = e


class Report:
  """Collects rows, prints progress, and writes JSON and Markdown after every row (a
  run cut short keeps what it measured) and a PNG plot at the end.

  ``unit``: "GB/s" (memory-bound ops: rows give the bytes that must move) or "TFLOP/s"
  (attention: rows give the FLOPs, and the peak memory of each call is recorded)."""

  def __init__(self, name: str, total: int, out_dir: str, unit: str = "GB/s",
               modes: Sequence[str] = ("fwd", "fwd+bwd"),
               summary: Callable[[list[Row]], str] | None = None,
               flops_doc: str = ATTENTION_FLOPS):
    assert unit in ("GB/s", "TFLOP/s"), unit
    self.name, self.total, self.rows, self.unit = name, total, [], unit
    # The modes to measure (benchmarks that have several), and an optional function of
    # the rows whose Markdown ends the table.
    self.modes, self.summary = tuple(modes), summary
    self.flops_doc = flops_doc  # what the TFLOP/s count, for the table's header
    os.makedirs(out_dir, exist_ok=True)
    self.path = os.path.join(out_dir, name)
    self.started = time.time()
    self.meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                     backend=jax.default_backend(),
                     date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))

  def rate(self, row: Row) -> float | None:
    return row.gbps if self.unit == "GB/s" else row.tflops

  def add(self, row: Row):
    self.rows.append(row)
    if row.median_us is None:
      speed = f"not measured: {row.note}"
    elif self.unit == "GB/s":
      speed = f"{row.median_us:9.1f} us {row.gbps:7.0f} GB/s {row.pct_ceiling:5.1f}%"
    else:
      speed = f"{row.median_us:9.1f} us {row.tflops:6.0f} TFLOP/s {row.peak_mib:8.0f} MiB"
    err = f"err {row.max_abs_err:.1e}" if row.max_abs_err is not None else ""
    if row.sm_mhz is not None:
      err += f" SM {row.sm_mhz:.0f} MHz" + (f" ({row.slowdowns})" if row.slowdowns else "")
    print(f"[{len(self.rows):3d}/{self.total} {time.time() - self.started:5.0f}s] "
          f"{row.op:12s} {row.mode:7s} {row.impl:22s} {row.shape:16s} {row.dtype:8s} "
          f"{speed} {err}", flush=True)
    self._write_tables()

  def measure(self, **row):
    """Times one row and adds it: `measure_rounds` of that row alone, in one round.
    Returns its rate, or None."""
    return self.measure_rounds([row], rounds=1)[0]

  def measure_rounds(self, rows: Sequence[dict], rounds: int | None = None):
    """Times ``rows`` in interleaved rounds and adds them in their order; returns each
    one's rate, or None where it failed.

    Each row is a dict of ``op``, ``impl``, ``shape``, ``dtype``, ``mode``, ``fn`` and
    ``arg_sets``, with optional ``nbytes`` (the minimum traffic of one call: GB/s
    reports), ``flops`` (its FLOPs: TFLOP/s reports), ``truth`` and ``compare`` (errors
    are of ``compare(output)``, default the output, against ``truth``),
    ``ceiling_gbps``, ``ceiling`` ("copy"), ``note`` (the row's note column) and
    ``context`` (a function giving the context manager its calls run in, e.g. one that
    sets what a kernel reads when it traces). A failure becomes a row that says why.

    Round r times the rows in their order, in reverse where r is odd (A B C, C B A,
    ...), each for ITERATIONS / rounds iterations (at least 2): with an even count of
    rounds every row sits at the same mean place in the run, so a GPU that lowers its
    clock as the run goes on (`ClockSampler`) slows them alike rather than the ones
    timed last. ``rounds`` defaults to BENCH_ROUNDS, else 1 (one row after the other).
    """
    if rounds is None:
      rounds = int(os.environ.get("BENCH_ROUNDS", "1"))
    if rounds < 1:
      raise ValueError(f"rounds (BENCH_ROUNDS) must be at least 1, got {rounds}")
    iterations = max(2, math.ceil(ITERATIONS / rounds))
    pending = [_Pending(row) for row in rows]
    for p in pending:
      p.prepare()
    wall_runs = math.ceil(3 / rounds)  # three in all, as one round has, one at least
    for r in range(rounds):
      for p in (pending if r % 2 == 0 else pending[::-1]):
        p.time_round(iterations, wall_runs)
    return [self._add_timed(p, rounds) for p in pending]

  def _add_timed(self, p: _Pending, rounds: int) -> float | None:
    """Adds the row of a timed `_Pending`, or the row of its failure; its rate."""
    row = p.row
    common = (row["op"], row["impl"], "x".join(map(str, row["shape"])), row["dtype"],
              row["mode"])
    ceiling, note = row.get("ceiling", "copy"), row.get("note", "")
    if p.failure is not None:
      self.add(Row(*common, None, None, None, None, None, None, ceiling, "",
                   note=failure_note(p.failure)))
      return None
    device_us, wall_us, timer = p.timer.result
    sm = dict(zip(("sm_mhz", "sm_mhz_min", "slowdowns"), p.clocks.result or ()),
              rounds=rounds)
    if row.get("flops") is not None:
      self.add(Row(*common, *p.err, device_us, wall_us, None, None, "", timer, note=note,
                   tflops=row["flops"] / device_us / 1e6, peak_mib=p.peak, **sm))
      return self.rows[-1].tflops
    gbps = row["nbytes"] / device_us / 1e3
    ceiling_gbps = row.get("ceiling_gbps")
    pct = 100 * gbps / ceiling_gbps if ceiling_gbps else 100.0
    self.add(Row(*common, *p.err, device_us, wall_us, gbps, pct, ceiling, timer,
                 note=note, **sm))
    return gbps

  def skip(self, *, op, impl, shape, dtype, mode, note):
    """A row for a measurement that was not attempted, saying why."""
    self.add(Row(op, impl, "x".join(map(str, shape)), dtype, mode, None, None, None, None,
                 None, None, "", "", note=note))

  def _write_tables(self):
    with open(self.path + ".json", "w") as f:
      json.dump(dict(meta=self.meta, rows=[dataclasses.asdict(r) for r in self.rows]), f,
                indent=1)
    with open(self.path + ".md", "w") as f:
      f.write(self.markdown())

  def finish(self):
    self.plot(self.path + ".png")
    print(f"wrote {self.path}.json/.md/.png", flush=True)

  def markdown(self) -> str:
    m = self.meta
    fmt = lambda v, f: "" if v is None else format(v, f)
    header = (f"{m['device']}, JAX {m['jax']}, {m['date']}. Device time: median over "
              f"{ITERATIONS} iterations of the kernels' summed durations")
    # Rows timed in interleaved rounds (`Report.measure_rounds`): the header says so
    # where every row was; in a merge of runs timed both ways, each such row's note.
    rounds = {r.rounds for r in self.rows if r.median_us is not None}
    mixed = len(rounds) > 1
    if mixed:
      header += (", some rows timed in rounds that alternate the rows' order "
                 "(`Report.measure_rounds`), as their notes say")
    elif rounds and (n := rounds.pop()) > 1:
      header += (f", timed in {n} rounds of {math.ceil(ITERATIONS / n)} that alternate "
                 "the rows' order (`Report.measure_rounds`)")
    rounds_note = lambda r: f"timed in {r.rounds} rounds" if mixed and r.rounds > 1 else ""
    header += "; "
    if self.unit == "GB/s":
      header += ("GB/s over the minimum traffic; % of the ceiling (copy or read) measured "
                 "in the same run.")
      columns = "GB/s | % of ceiling"
      extra = lambda r: (f"{fmt(r.gbps, '.0f')} | "
                         + ("" if r.pct_ceiling is None else f"{r.pct_ceiling:.1f}% {r.ceiling}"))
    else:
      header += (f"TFLOP/s over {self.flops_doc}, from the device time and (e2e) from the "
                 "end-to-end time; peak MiB: temporaries + outputs of the compiled call.")
      columns = "TFLOP/s | e2e TFLOP/s | peak MiB"
      extra = lambda r: (f"{fmt(r.tflops, '.0f')} | {fmt(r.tflops_e2e, '.0f')} | "
                         f"{fmt(r.peak_mib, '.0f')}")
    header += (" wall us: end to end per call, wall clock over pipelined calls "
               "(`time_call`).")
    if any(r.slowdowns for r in self.rows):
      header += (" Where the GPU lowered its SM clock while a row was timed, the row's "
                 "note gives the median and lowest clock and NVML's reasons "
                 "(`ClockSampler`).")
    titles = ("| op | mode | impl | shape | dtype | max abs err | max rel err | median us "
              f"| wall us | {columns} | note |")
    lines = [f"# {self.name}", "", header, "", titles, "|" + "---|" * (titles.count("|") - 1)]
    for r in self.rows:
      lines.append(
          f"| {r.op} | {r.mode} | {r.impl} | {r.shape} | {r.dtype} | "
          f"{fmt(r.max_abs_err, '.1e')} | {fmt(r.max_rel_err, '.1e')} | "
          f"{fmt(r.median_us, '.1f')} | {fmt(r.wall_us, '.1f')} | {extra(r)} | "
          f"{'; '.join(filter(None, (r.note, r.clock_note, rounds_note(r))))} |")
    return "\n".join(lines) + "\n" + (self.summary(self.rows) if self.summary else "")

  def plot(self, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = sorted({(r.op, r.mode) for r in self.rows if self.rate(r) is not None})
    if not groups:
      return
    fig, axes = plt.subplots(len(groups), 1, figsize=(12, 3.2 * len(groups)), squeeze=False)
    for ax, (op, mode) in zip(axes[:, 0], groups):
      rows = [r for r in self.rows if (r.op, r.mode) == (op, mode) and self.rate(r) is not None]
      shapes = list(dict.fromkeys(f"{r.shape} {r.dtype}" for r in rows))
      impls = list(dict.fromkeys(r.impl for r in rows))
      width = 0.8 / len(impls)
      for k, impl in enumerate(impls):
        vals = {f"{r.shape} {r.dtype}": self.rate(r) for r in rows if r.impl == impl}
        ax.bar([i + k * width for i in range(len(shapes))],
               [vals.get(s, 0) for s in shapes], width, label=impl)
      ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], shapes, fontsize=7)
      ax.set_ylabel(self.unit)
      ax.set_title(f"{op} {mode}")
      ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure_ceilings(report: Report, x_sets, *, shape, dtype) -> tuple[float, float]:
  """Copy and read bandwidth (GB/s) on these inputs, as rows of the report."""
  nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize
  common = dict(shape=shape, dtype=jnp.dtype(dtype).name)
  copy = report.measure(op="ceiling", impl="pallas copy", mode="copy", fn=copy_kernel,
                        arg_sets=x_sets, nbytes=2 * nbytes, **common)
  read = report.measure(op="ceiling", impl="pallas read", mode="read", fn=read_kernel,
                        arg_sets=x_sets, nbytes=nbytes, ceiling="read", **common)
  return copy, read


def add_shape_args(parser: argparse.ArgumentParser):
  """``--out``, ``--smoke`` and ``--only``, which `chosen_shapes` reads."""
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, any backend")
  parser.add_argument("--only", default=None,
                      help="comma-separated indices of the shapes to run (default: all)")


def chosen_shapes(args, shapes, smoke_shapes):
  """The shapes ``--smoke`` and ``--only`` pick (`add_shape_args`)."""
  shapes = smoke_shapes if args.smoke else shapes
  if args.only is not None:
    shapes = [shapes[int(i)] for i in args.only.split(",")]
  return shapes


def write_lines(out_dir: str, filename: str, lines: Sequence[str]):
  """Writes ``lines`` to out_dir/filename, making the directory, and prints them."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, filename), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


def run(name: str, doc: str, shapes, smoke_shapes, bench_shape, rows_per_shape,
        unit: str = "GB/s", summary: Callable[[list[Row]], str] | None = None,
        flops_doc: str = ATTENTION_FLOPS, default_modes: str = "fwd,fwd+bwd"):
  """The command line every benchmark script shares: ``--out``, ``--smoke``, ``--only``,
  ``--name``, ``--modes``.

  ``bench_shape(report, shape, dtype)`` adds the rows of one shape;
  ``rows_per_shape(shape, dtype, modes)`` says how many, for the progress count.
  Benchmarks time compiled kernels; only a --smoke run (tiny shapes, interpreted kernels,
  wall-clock times) of the scripts themselves may run without a GPU.
  """
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  add_shape_args(parser)
  parser.add_argument("--name", default=name, help="file name of the results")
  parser.add_argument("--modes", default=default_modes,
                      help="comma-separated modes, for benchmarks that have several")
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    if not args.smoke:
      sys.exit("benchmarks time compiled kernels: run them on a GPU (or pass --smoke)")
    # Off a GPU the ops would take their XLA path: a smoke run interprets the kernels.
    os.environ.setdefault("JAXSOFTMAX_INTERPRET", "1")
  shapes = chosen_shapes(args, shapes, smoke_shapes)
  modes = args.modes.split(",")
  total = sum(rows_per_shape(shape, dtype, modes) for shape, dtype in shapes)
  report = Report(args.name, total=total, out_dir=args.out, unit=unit, modes=modes,
                  summary=summary, flops_doc=flops_doc)
  for shape, dtype in shapes:
    bench_shape(report, shape, dtype)
  report.finish()
