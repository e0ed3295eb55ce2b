"""`_core.pallas`: interpret-mode resolution, where a call runs, and the silenced deprecation
warning."""

import subprocess
import sys

import pytest

from jaxsoftmax._core import pallas


def test_argument_wins_over_environment(monkeypatch):
  monkeypatch.setenv("JAXSOFTMAX_INTERPRET", "1")
  assert pallas.resolve_interpret(False) is False
  assert pallas.resolve_interpret(None) is True
  monkeypatch.setenv("JAXSOFTMAX_INTERPRET", "0")
  assert pallas.resolve_interpret(None) is False


def test_bad_values_are_errors(monkeypatch):
  with pytest.raises(TypeError, match="interpret must be a bool"):
    pallas.resolve_interpret("yes")
  monkeypatch.setenv("JAXSOFTMAX_INTERPRET", "maybe")
  with pytest.raises(ValueError, match="JAXSOFTMAX_INTERPRET='maybe'"):
    pallas.resolve_interpret(None)


def test_automatic_choice_follows_the_backend(monkeypatch):
  import jax
  monkeypatch.delenv("JAXSOFTMAX_INTERPRET", raising=False)
  assert pallas.resolve_interpret(None) == (jax.default_backend() != "gpu")


@pytest.mark.gpu
def test_users_do_not_see_the_triton_deprecation_warning():
  # -W default shows every DeprecationWarning that is not filtered on purpose.
  script = ("import jax.numpy as jnp, jaxsoftmax as js;"
            "print(float(js.softmax(jnp.arange(5.0)).sum()))")
  run = subprocess.run([sys.executable, "-W", "default", "-c", script],
                       capture_output=True, text=True, check=True)
  assert abs(float(run.stdout) - 1.0) < 1e-6
  assert "Pallas Triton backend is deprecated" not in run.stderr


def test_deterministic_follows_xla_flags(monkeypatch):
  # The argument wins; else XLA's own determinism flag decides.
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert pallas.resolve_deterministic(None) is False
  assert pallas.resolve_deterministic(True) is True
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true --xla_foo=1")
  assert pallas.resolve_deterministic(None) is True
  assert pallas.resolve_deterministic(False) is False
  with pytest.raises(TypeError, match="deterministic must be a bool or None"):
    pallas.resolve_deterministic(1)
