"""`_core.backends`: the registry's dispatch rule, and every op's backends meeting their
protocol."""

import dataclasses

import pytest

from jaxsoftmax._core.backends import Backend, Registry
from jaxsoftmax.attention import api
from jaxsoftmax.attention.call import AttentionBackend


@dataclasses.dataclass(frozen=True)
class _Fake:
  NAME: str
  refuses: frozenset = frozenset()  # the calls it cannot run

  def unsupported(self, call):
    return f"{self.NAME} refuses {call}" if call in self.refuses else None


FAST, SLOW = _Fake("fast", frozenset({"big"})), _Fake("slow")
REGISTRY = Registry("op", (FAST, SLOW), otherwise="implementation='xla' instead")


def test_first_that_can_run_the_call():
  assert REGISTRY.select(None, "small") is FAST
  assert REGISTRY.select(None, "big") is SLOW
  assert REGISTRY.names == ("fast", "slow") and REGISTRY["slow"] is SLOW


def test_a_named_backend_runs_the_call_or_says_why_not():
  assert REGISTRY.select("slow", "small") is SLOW
  with pytest.raises(ValueError, match=r"^op: implementation='fast' cannot run this call: "
                                       r"fast refuses big$"):
    REGISTRY.select("fast", "big")
  with pytest.raises(KeyError, match="no backend named 'medium'"):
    REGISTRY.select("medium", "small")


def test_when_none_can_the_error_lists_each_reason():
  picky = Registry("op", (FAST, _Fake("slow", frozenset({"big"}))), otherwise="try x")
  with pytest.raises(ValueError, match=r"^op: no kernel backend can run this call \(fast: "
                                       r"fast refuses big; slow: slow refuses big\); try x$"):
    picky.select(None, "big")


def test_names_are_unique():
  with pytest.raises(ValueError, match="two backends share a name"):
    Registry("op", (FAST, FAST))


def test_attention_backends_meet_the_protocol():
  for backend in api.REGISTRY.backends:
    assert isinstance(backend, Backend) and isinstance(backend, AttentionBackend), backend
  assert api.IMPLEMENTATIONS == (None, "mosaic_gpu", "triton", "xla")
