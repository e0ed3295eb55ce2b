"""Shared test set-up: the gpu marker, a fresh-but-reproducible key per test, and strict
rank promotion.

Tests that need compiled kernels carry ``@pytest.mark.gpu``; they are skipped unless JAX's
default backend is a GPU. Everything else runs the kernels in Pallas interpret mode
(``JAXSOFTMAX_INTERPRET=1`` is set here off a GPU, where the ops would otherwise take
their XLA path), so the whole suite runs on a CPU. On the GPU machine run
``pytest -m gpu``.

The CPU has 8 virtual devices (``--xla_force_host_platform_device_count``), for the
context-parallel tests, and XLA compiles without LLVM's optimizations there. The suite
runs with ``jax_numpy_rank_promotion="raise"`` (set here for this process and, through
the environment, for the scripts the tests start), a setting many codebases use:
library code must broadcast explicitly.
"""

import importlib.util
import os
import zlib


def _cuda_installed() -> bool:
  """Whether a CUDA plugin for JAX is installed (jax_cuda12_plugin, jax_cuda13_plugin)."""
  return any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))


os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
# Eight virtual CPU devices for the context-parallel tests (the host platform only).
flags = [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
if not _cuda_installed():
  # Without a GPU the suite compiles thousands of small programs (interpreted kernels
  # among them) and runs each once or twice: LLVM's optimizations cost more than they
  # save (13 instead of 19.5 minutes on 2 cores). The flag reaches every backend, so a
  # CUDA install keeps the default (docs/testing.md).
  flags.append("--xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = " ".join(flags).strip()

import jax  # noqa: E402 - after the environment it reads
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

ON_GPU = jax.default_backend() == "gpu"
if not ON_GPU:  # the kernels, interpreted (tests of the XLA path unset it)
  os.environ.setdefault("JAXSOFTMAX_INTERPRET", "1")


def tests_done(paths: str) -> set[str]:
  """The ids of the tests that passed or were skipped in the logs ``paths``
  (comma-separated): `pytest -v` output or JAXSOFTMAX_TEST_TIMES files. A line that says
  failed or error anywhere (a failure's message may say "passed") counts for nothing,
  nor does a passed setup, which says nothing of the call."""
  done = set()
  for path in filter(None, paths.split(",")):
    with open(path) as f:
      for line in f:
        words = line.split()
        ids = [w for w in words if "::" in w]
        outcomes = {w.lower() for w in words}
        if (not ids or outcomes & {"failed", "error"}
            or not outcomes & {"passed", "skipped"}
            or ("setup" in words and "skipped" not in outcomes)):
          continue
        done.add(ids[0])
  return done


def pytest_collection_modifyitems(config, items):
  # JAXSOFTMAX_TESTS_DONE=LOG[,LOG]: leaves out the tests those logs record as passed or
  # skipped, so that a GPU run its time limit cut goes on where it stopped in the next
  # device call (benchmarks/run_gpu.sh, docs/testing.md).
  done = tests_done(os.environ.get("JAXSOFTMAX_TESTS_DONE", ""))
  if done:
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid in done])
    items[:] = [i for i in items if i.nodeid not in done]
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs a GPU (compiled Pallas kernels)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def pytest_runtest_logreport(report):
  # JAXSOFTMAX_TEST_TIMES=FILE: each test's setup and call seconds appended to FILE as it
  # finishes, so that a GPU run its time limit cuts still says where the time went
  # (benchmarks/run_gpu.sh). Under xdist the controller writes (a worker has
  # PYTEST_XDIST_WORKER set).
  path = os.environ.get("JAXSOFTMAX_TEST_TIMES")
  if path and "PYTEST_XDIST_WORKER" not in os.environ and report.when != "teardown":
    with open(path, "a") as f:
      f.write(f"{report.duration:8.1f} s {report.when:5} {report.outcome:7} {report.nodeid}\n")


@pytest.fixture
def key(request):
  """A PRNG key of its own for each test; JAXSOFTMAX_TEST_SEED changes them all. Tests
  run once per kernel backend (a ``backend`` parameter) share one key per case: the id
  without the backend, so that every backend sees the same input."""
  nodeid = request.node.nodeid
  callspec = getattr(request.node, "callspec", None)
  backend = callspec.params.get("backend") if callspec else None
  if backend:
    nodeid = nodeid.replace(f"[{backend}-", "[", 1).replace(f"[{backend}]", "")
  seed = int(os.environ.get("JAXSOFTMAX_TEST_SEED", "0"))
  return jax.random.PRNGKey(zlib.crc32(nodeid.encode()) ^ seed)


@pytest.fixture
def as_if_on_an_h200(monkeypatch):
  """Pallas' Triton lowering asks the device for its compute capability: answer as an
  H200 would, so that the kernels lower for CUDA on a machine without a GPU. (The
  module that answers is Pallas' own up to JAX 0.12.0, JAX's from 0.12.1.)"""
  try:
    from jax._src import gpu_info
  except ImportError:
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
  if not hasattr(gpu_info, "GpuVersion"):
    pytest.skip("this JAX's Triton lowering has no GpuVersion table")
  monkeypatch.setattr(gpu_info, "get_gpu_info",
                      lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
