"""`_core.backends`: the registry's dispatch rule, every op's backends meeting their
protocol, and the row ops' ``implementation=``."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoftmax as js
from jaxsoftmax._core.backends import Backend, Registry
from jaxsoftmax.attention import api
from jaxsoftmax.attention.call import AttentionBackend, BackwardBackend
from jaxsoftmax.linear_cross_entropy import api as lce_api
from jaxsoftmax.rows import backends as rows_backends


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


@dataclasses.dataclass(frozen=True)
class _Deferring(_Fake):
  def defers(self, call):
    return "a later one is faster" if call.startswith("packed") else None


def test_a_backend_may_defer_a_call_to_a_later_one():
  # Unnamed, a call the first backend defers goes to the next that can run it, and to
  # the deferring one where none can; named, the deferring one runs it.
  deferring = _Deferring("fast")
  registry = Registry("op", (deferring, _Fake("slow", frozenset({"packed-big"}))))
  assert registry.select(None, "packed").NAME == "slow"
  assert registry.select(None, "small") is deferring
  assert registry.select(None, "packed-big") is deferring
  assert registry.select("fast", "packed") is deferring


def test_packed_segments_go_to_the_triton_kernels(monkeypatch):
  # Where the Hopper kernels could run them, the caller's segment ids go to the Triton
  # kernels, which skip the tiles whose ids cannot match (docs/kernels.md); a key mask
  # run as segment ids, or a name, keeps the Hopper ones.
  from jaxsoftmax.attention import mosaic_gpu
  monkeypatch.setattr(mosaic_gpu, "unsupported", lambda call: None)
  q = jnp.zeros((2, 64, 4, 64), jnp.bfloat16)
  segments = jnp.zeros((2, 64), jnp.int32)
  def plan(mask=None, segment_ids=None, implementation=None):
    return api._plan(q, q, q, None, mask, scale=None, is_causal=True,
                     query_seq_lengths=None, key_value_seq_lengths=None,
                     local_window_size=None, implementation=implementation,
                     logits_soft_cap=None, segment_ids=segment_ids, block_sizes=None,
                     interpret=True, deterministic=None)

  packed = plan(segment_ids=segments)
  assert packed.call.packed and packed.backend.NAME == "triton"
  assert "segment ids" in mosaic_gpu.defers(packed.call)
  assert plan(segment_ids=segments, implementation="mosaic_gpu").backend.NAME == "mosaic_gpu"
  masked = plan(mask=jnp.ones((2, 1, 1, 64), bool))
  assert not masked.call.packed and masked.backend.NAME == "mosaic_gpu"


def test_ring_steps_with_segments_are_packed():
  # Ring attention's steps are calls of the same kernels: with segment ids they are
  # packed calls too, which the Hopper backend defers to the Triton kernels.
  from jaxsoftmax.attention.context_parallel import ring
  plan = ring._RingPlan(axis_name="x", shards=2, layout="contiguous", strategy="ring",
                        is_causal=True, window=None, has_segments=True, scale=0.125,
                        softcap=None, implementation=None, block_sizes=None, interpret=True,
                        deterministic=False, B=2, T=64, S=64, N=4, K=4, H=64,
                        dtype="bfloat16")
  [piece] = plan._whole(64, 0)
  assert plan.call(piece).packed
  assert not dataclasses.replace(plan, has_segments=False).call(piece).packed


def test_names_are_unique():
  with pytest.raises(ValueError, match="two backends share a name"):
    Registry("op", (FAST, FAST))


def test_attention_backends_meet_the_protocol():
  for backend in api.REGISTRY.backends:
    assert isinstance(backend, Backend) and isinstance(backend, AttentionBackend), backend
  # The decode kernel's forward is differentiated by the Triton backward.
  assert [b.NAME for b in api.REGISTRY.backends if isinstance(b, BackwardBackend)] == [
      "mosaic_gpu", "triton"]
  assert api.IMPLEMENTATIONS == (None, "decode", "mosaic_gpu", "triton", "xla")


def test_linear_cross_entropy_backends_meet_the_protocol():
  for backend in lce_api.REGISTRY.backends:
    assert isinstance(backend, Backend), backend
    assert callable(backend.forward) and callable(backend.chunk_ds), backend
    assert isinstance(backend.STATE_FROM_XLA, bool), backend
  assert lce_api.IMPLEMENTATIONS == (None, "mosaic_gpu", "triton", "xla_chunks", "xla")


ROW_OPS = {
    "softmax": lambda x, **kw: js.softmax(x, **kw),
    "log_softmax": lambda x, **kw: js.log_softmax(x, **kw),
    "logsumexp": lambda x, **kw: js.logsumexp(x, axis=-1, **kw),
    "cross_entropy": lambda x, **kw: js.cross_entropy(x, jnp.zeros(x.shape[:-1], jnp.int32),
                                                      **kw),
    "layer_norm": lambda x, **kw: js.layer_norm(x, jnp.ones(x.shape[-1]), **kw),
    "rms_norm": lambda x, **kw: js.rms_norm(x, jnp.ones(x.shape[-1]), **kw),
}


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the defaults off a GPU")
@pytest.mark.parametrize("op", ROW_OPS)
def test_row_ops_implementation(op, monkeypatch):
  # The row ops' seam (rows.backends.xla_path): "triton" runs the row engine's kernels
  # (interpreted off a GPU), "xla" and, off a GPU, the default the XLA path; anything
  # else is an error that names the argument.
  monkeypatch.delenv("JAXSOFTMAX_INTERPRET", raising=False)
  fn, x = ROW_OPS[op], jnp.linspace(-2.0, 2.0, 3 * 40).reshape(3, 40)
  kernels = lambda **kw: "pallas_call" in str(jax.make_jaxpr(lambda x: fn(x, **kw))(x))
  assert kernels(implementation="triton")
  assert not kernels(implementation="xla") and not kernels()
  np.testing.assert_allclose(fn(x, implementation="triton"), fn(x, implementation="xla"),
                             rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match=f"{op}: implementation must be one of"):
    fn(x, implementation="cuda")


def test_row_ops_backends_meet_the_protocol():
  for backend in rows_backends.REGISTRY.backends:
    assert isinstance(backend, Backend), backend
  assert rows_backends.IMPLEMENTATIONS == (None, "triton", "xla")
