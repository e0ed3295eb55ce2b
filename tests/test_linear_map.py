"""LinearMap: a map that runs its kernel when evaluated and transposed, and is
differentiated through its twin, supports every mode of autodiff and vmap.

The kernels here are host callbacks, which JAX can neither differentiate nor transpose,
as it cannot a Pallas kernel: every derivative must come from the map's rules.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxsoftmax._core.linear_map import LinearMap

CALLS = []


def _callback(name, fn):
  def kernel(res, t):
    def host(*arrays):
      CALLS.append(name)
      return np.asarray(fn(*arrays), arrays[0].dtype)
    y, dx = res[0], t[0]
    return (jax.pure_callback(host, jax.ShapeDtypeStruct(dx.shape, dx.dtype), y, dx,
                              vmap_method="expand_dims"),)
  return kernel


def _softmax_tangent(y, dx):  # y · (dx - sum(dx · y)): self-adjoint
  return y * (dx - (dx * y).sum(-1, keepdims=True))


TANGENT = LinearMap("toy_softmax_tangent", kernel=_callback("kernel", _softmax_tangent),
                    twin=lambda res, t: (_softmax_tangent(res[0], t[0]),))
TANGENT.pair(TANGENT)


@jax.custom_jvp
def softmax(x):
  y = jnp.exp(x - jax.lax.stop_gradient(x.max(-1, keepdims=True)))
  return y / y.sum(-1, keepdims=True)


@softmax.defjvp
def _softmax_jvp(primals, tangents):
  y = softmax(primals[0])
  return y, TANGENT((y,), (tangents[0],))[0]


def _objective(fn, x):
  return jnp.sum(jnp.sin(fn(x)) * jnp.arange(x.shape[-1])[None, :])


@pytest.fixture
def x():
  return jax.random.normal(jax.random.PRNGKey(0), (3, 6), jnp.float32)


def test_first_order_runs_the_kernel_once(x):
  for transform in (lambda f: jax.grad(f)(x),
                    lambda f: jax.jvp(f, (x,), (jnp.cos(x),))[1]):
    CALLS.clear()
    got = transform(functools.partial(_objective, softmax))
    want = transform(functools.partial(_objective, jax.nn.softmax))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert CALLS == ["kernel"]  # evaluated (jvp) or transposed (grad): the kernel


@pytest.mark.parametrize("transform", [
    pytest.param(lambda f, x: jax.hessian(f)(x), id="hessian"),
    pytest.param(lambda f, x: jax.jvp(jax.grad(f), (x,), (jnp.cos(x),))[1], id="jvp-of-grad"),
    pytest.param(lambda f, x: jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(x),
                 id="grad-of-grad"),
    pytest.param(lambda f, x: jax.jacfwd(f)(x), id="jacfwd"),
    pytest.param(lambda f, x: jax.jit(jax.vmap(jax.grad(f)))(x[:, None]), id="vmap-of-grad"),
])
def test_higher_order_and_vmap(x, transform):
  got = transform(functools.partial(_objective, softmax), x)
  want = transform(functools.partial(_objective, jax.nn.softmax), x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_check_grads_both_modes(x):
  check_grads(softmax, (x,), order=2, modes=("fwd", "rev"), atol=1e-2, rtol=1e-2)


def test_residuals_cannot_be_transposed(x):
  # The map is linear in t only: transposing it in its residual is an error.
  with pytest.raises(ValueError, match="linear in its inputs t only"):
    jax.linear_transpose(lambda y: TANGENT((y,), (x,))[0], x)(x)
