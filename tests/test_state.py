"""Public state merges: the merge of parts equals the whole, and empty parts are safe."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoftmax as js


def _state(x):
  m = jnp.max(x, axis=-1)
  shift = jnp.where(jnp.isfinite(m), m, 0)
  return m, jnp.sum(jnp.exp(x - shift[:, None]), axis=-1)


def test_merge_states_equals_state_of_the_union(key):
  x = 5 * jax.random.normal(key, (6, 40))
  x = x.at[2].set(-jnp.inf).at[3, :25].set(-jnp.inf)  # an empty row, an empty part
  m, l = js.merge_states(*_state(x[:, :25]), *_state(x[:, 25:]))
  m_all, l_all = _state(x)
  np.testing.assert_array_equal(m, m_all)
  np.testing.assert_allclose(l, l_all, rtol=1e-6)
  np.testing.assert_allclose(js.state_lse(m, l), jax.nn.logsumexp(x, axis=-1), rtol=1e-6)
  assert js.state_lse(m, l)[2] == -jnp.inf


def test_reduce_states_of_many_parts(key):
  x = 5 * jax.random.normal(key, (3, 60))
  parts = [_state(x[:, i:i + 20]) for i in range(0, 60, 20)]
  m, l = js.reduce_states(jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts]))
  np.testing.assert_allclose(js.state_lse(m, l), jax.nn.logsumexp(x, axis=-1), rtol=1e-6)


def _attention(q, k, v):
  s = q @ k.T
  lse = jax.nn.logsumexp(s, axis=-1)
  return jax.nn.softmax(s, axis=-1) @ v, lse


def test_merge_attention_states_equals_attention_over_all_keys(key):
  kq, kk, kv = jax.random.split(key, 3)
  q, k, v = (jax.random.normal(kk_, shape) for kk_, shape in
             ((kq, (5, 8)), (kk, (30, 8)), (kv, (30, 8))))
  o_a, lse_a = _attention(q, k[:12], v[:12])
  o_b, lse_b = _attention(q, k[12:], v[12:])
  o, lse = js.merge_attention_states(o_a, lse_a, o_b, lse_b)
  o_all, lse_all = _attention(q, k, v)
  np.testing.assert_allclose(o, o_all, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse, lse_all, rtol=1e-6)


def test_merge_attention_states_with_empty_parts():
  o = jnp.ones((2, 4))
  lse = jnp.array([0.5, -jnp.inf])
  empty_o, empty_lse = jnp.zeros((2, 4)), jnp.full((2,), -jnp.inf)
  merged_o, merged_lse = js.merge_attention_states(o, lse, empty_o, empty_lse)
  np.testing.assert_array_equal(merged_o[0], 1.0)
  np.testing.assert_array_equal(merged_o[1], 0.0)  # empty in both: 0, not NaN
  np.testing.assert_array_equal(merged_lse, lse)


def test_merge_attention_states_checks_shapes():
  with pytest.raises(ValueError, match=r"o_a \(2, 4\), o_b \(2, 4\), lse_a \(3,\)"):
    js.merge_attention_states(jnp.ones((2, 4)), jnp.ones(3), jnp.ones((2, 4)), jnp.ones(3))


def test_reduce_lse(key):
  x = jax.random.normal(key, (4, 30))
  parts = jnp.stack([jax.nn.logsumexp(x[:, :10], -1), jax.nn.logsumexp(x[:, 10:], -1),
                     jnp.full((4,), -jnp.inf)])
  np.testing.assert_allclose(js.reduce_lse(parts), jax.nn.logsumexp(x, -1), rtol=1e-6)
