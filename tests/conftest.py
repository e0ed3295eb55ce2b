"""Shared test set-up: the gpu marker, and a fresh-but-reproducible key per test.

Tests that need compiled kernels carry ``@pytest.mark.gpu``; they are skipped unless JAX's
default backend is a GPU. Everything else runs the kernels in Pallas interpret mode, so
the whole suite runs on a CPU. On the GPU machine run ``pytest -m gpu``.
"""

import os
import zlib

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs a GPU (compiled Pallas kernels)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def key(request):
  """A PRNG key of its own for each test; JAXSOFTMAX_TEST_SEED changes them all."""
  seed = int(os.environ.get("JAXSOFTMAX_TEST_SEED", "0"))
  return jax.random.PRNGKey(zlib.crc32(request.node.nodeid.encode()) ^ seed)
