"""The one tolerance rule of the test suite (docs/testing.md, "The 2x rule"), the
truth it compares to, and the derivative checks against an op's jax.nn / optax twin.

A kernel result passes when its largest error against the float64 truth is at most twice
the largest error of the same computation done by the pure-jnp reference in the input
dtype, plus a floor of a few float32 ulps of the result's scale (so that exact cases stay
exact up to float32 rounding). Non-finite values must match the truth rounded to the
result's dtype exactly: NaN where it is NaN, the same infinity where it is infinite
(float16 results overflow where the float64 truth does not).
"""

import jax
import jax.numpy as jnp
import numpy as np

# Largest ratio of kernel error to reference error that passes.
RATIO = 2.0
FLOOR_ULPS = 4


def truth(fn, *args):
  """fn evaluated in float64 on float64 copies of the floating ``args`` (None passes)."""
  with jax.enable_x64(True):
    cast = [a if a is None else jnp.asarray(_to64(a)) if _is_float(a) else jnp.asarray(a)
            for a in args]
    return jax.tree.map(np.asarray, jax.jit(fn)(*cast))


def _is_float(a):
  return jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)


def _to64(a) -> np.ndarray:
  return np.asarray(a).astype(np.float64)


def max_errors(actual, expected):
  """(max abs err, max rel err) over the elements where ``expected`` is finite."""
  actual, expected = _to64(actual), _to64(expected)
  finite = np.isfinite(expected)
  if not finite.any():
    return 0.0, 0.0
  diff = np.abs(actual[finite] - expected[finite])
  rel = diff / np.maximum(np.abs(expected[finite]), np.finfo(np.float32).tiny)
  return float(np.max(diff)), float(np.max(rel))


def assert_2x(actual, in_dtype, exact, *, what: str):
  """Checks ``actual`` against the float64 truth ``exact`` under the 2x rule, with
  ``in_dtype`` the reference computed in the input dtype."""
  dtype = np.asarray(actual).dtype
  actual, in_dtype, exact = _to64(actual), _to64(in_dtype), _to64(exact)
  assert actual.shape == exact.shape, f"{what}: shape {actual.shape} != {exact.shape}"
  with np.errstate(over="ignore"):  # the overflow is the point: where the dtype ends
    rounded = exact.astype(dtype)
  exact = np.where(np.isfinite(rounded), exact, rounded)
  nan = np.isnan(exact)
  np.testing.assert_array_equal(np.isnan(actual), nan, err_msg=f"{what}: NaN pattern")
  inf = np.isinf(exact)
  np.testing.assert_array_equal(actual[inf], exact[inf], err_msg=f"{what}: infinities")
  assert not np.isinf(actual[~inf & ~nan]).any(), f"{what}: infinity where truth is finite"
  err, _ = max_errors(actual, exact)
  err_ref, _ = max_errors(in_dtype, exact)
  finite = exact[np.isfinite(exact)]
  scale = max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0
  floor = FLOOR_ULPS * np.finfo(np.float32).eps * scale
  assert err <= RATIO * err_ref + floor, (
      f"{what}: max abs error {err:.3e} > {RATIO} x reference error {err_ref:.3e} "
      f"+ floor {floor:.1e}")


def assert_2x_or_kernel_form(actual, in_dtype, exact, *, what: str, kernel_form=None):
  """`assert_2x`, and where ``actual`` misses the rule against the reference's error,
  once more against that of ``kernel_form()`` (called only then): the same result
  formed as the kernels form it, where autodiff of the reference rounds less than any
  kernel can (docs/testing.md, "Where the rule needs a second reference")."""
  try:
    assert_2x(actual, in_dtype, exact, what=what)
  except AssertionError:
    if kernel_form is None:
      raise
    assert_2x(actual, kernel_form(), exact, what=f"{what} (against the kernels' form)")


def assert_same_derivatives(ours, theirs, x, *, hessian_at=None, jacobian_at=None):
  """jax.jvp, jax.jacfwd (at ``jacobian_at``, default x), jvp-of-grad and jax.hessian
  (at ``hessian_at``, default x) of the scalar functions ``ours`` and ``theirs`` agree,
  and ours are finite: the forward-mode and second-order checks of an op against its
  jax.nn / optax twin. A smaller point keeps the jacobian's and Hessian's batches of
  tangents small where interpreted kernels evaluate them."""
  hessian_at = x if hessian_at is None else hessian_at
  jacobian_at = x if jacobian_at is None else jacobian_at
  for transform in (lambda f: jax.jvp(f, (x,), (jnp.cos(x),))[1],
                    lambda f: jax.jacfwd(f)(jacobian_at),
                    lambda f: jax.jvp(jax.grad(f), (x,), (jnp.cos(x),))[1],
                    lambda f: jax.hessian(f)(hessian_at)):
    got, want = transform(ours), transform(theirs)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
