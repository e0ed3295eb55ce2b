"""softmax, log_softmax, logsumexp: forward and gradients against the float64 truth.

Every case runs the forward and the custom-VJP backward in one jitted vjp and checks
both under the 2x rule (tolerance.py). Interpret-mode cases run anywhere; the ``gpu``
cases compile the kernels and use the sizes the default tiling sends to each variant.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoftmax as js
from jaxsoftmax.softmax import reference
from jaxsoftmax.rows import RowTiling, default_tiling
from jaxprs import kernel_names
from tolerance import assert_2x, assert_2x_or_kernel_form, assert_same_derivatives, truth

OPS = {
    "softmax": (js.softmax, reference.softmax),
    "log_softmax": (js.log_softmax, reference.log_softmax),
    "logsumexp": (js.logsumexp, reference.logsumexp),
}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]

# (shape, tiling): the path each one exercises.
INTERPRET_CASES = [
    pytest.param((1, 1), None, id="length-one"),
    pytest.param((7, 97), None, id="resident-ragged"),  # 7 rows of 97 in a 128-wide tile
    pytest.param((97, 7), None, id="many-rows-ragged"),  # 8-wide tiles, rows % block != 0
    pytest.param((5, 1000), RowTiling("online", 2, 128), id="online-ragged"),  # 8 blocks
    pytest.param((3, 4097), RowTiling("split", 1, 256, 3), id="split-ragged"),  # 6 chunks
    pytest.param((2, 20000), None, id="split-default"),  # few long rows -> split
    # Shapes that are multiples of the tiling: the kernels compute no masks at all.
    pytest.param((4, 256), RowTiling("online", 2, 64), id="online-exact"),
    pytest.param((2, 512), RowTiling("split", 1, 64, 2), id="split-exact"),
]
GPU_CASES = [
    pytest.param((4096, 4096), None, id="resident-4096"),
    pytest.param((1000, 1000), None, id="resident-1000"),
    pytest.param((65537, 33), None, id="many-rows"),
    pytest.param((300, 40000), None, id="online-default"),  # >= 2 x SMs rows, long
    pytest.param((4, 1_000_003), None, id="split-default"),
    pytest.param((5, 1000), RowTiling("online", 2, 128), id="online-forced"),
    pytest.param((3, 4097), RowTiling("split", 1, 256, 3), id="split-forced"),
    # float32 log_softmax's gradient here was 3.5x XLA's error with exp as ex2.approx.
    pytest.param((2, 5000), None, id="resident-2x5000"),
]


def _run(name, x, dy, where, tiling, interpret):
  """Kernel forward and vjp, the reference's in x.dtype, and the float64 truth."""
  kernel, ref = OPS[name]
  f = functools.partial(kernel, axis=-1, where=where, tiling=tiling, interpret=interpret)
  r = functools.partial(ref, axis=-1, where=where)

  def fwd_bwd(fn, x, dy):
    y, vjp = jax.vjp(fn, x)
    return y, vjp(dy)[0]

  got = jax.jit(functools.partial(fwd_bwd, f))(x, dy)
  in_dtype = jax.jit(functools.partial(fwd_bwd, r))(x, dy)
  exact = truth(lambda x, dy, w: fwd_bwd(functools.partial(ref, axis=-1, where=w), x, dy),
                x, dy, where)
  return got, in_dtype, exact


def _check(name, x, dy, where=None, tiling=None, interpret=True, row_blocks=None):
  """Output and gradient under the 2x rule; ``row_blocks``: {label: rows}, each block of
  rows checked on its own (the ops are row-wise), instead of the whole."""
  got, in_dtype, exact = _run(name, x, dy, where, tiling, interpret)
  assert got[0].dtype == x.dtype and got[1].dtype == x.dtype
  # Formed once, and only where some block's gradient misses the rule.
  saved_output_form = functools.cache(lambda: _softmax_saved_output_form(exact[0], dy))
  for label, rows in (row_blocks or {"": slice(None)}).items():
    what = f"{name} {{}} {label}".rstrip()
    assert_2x(got[0][rows], in_dtype[0][rows], exact[0][rows], what=what.format("forward"))
    kernel_form = None
    if name == "softmax":
      kernel_form = lambda rows=rows: saved_output_form()[rows]
    assert_2x_or_kernel_form(got[1][rows], in_dtype[1][rows], exact[1][rows],
                             what=what.format("gradient"), kernel_form=kernel_form)


def _softmax_saved_output_form(exact_y, dy):
  """softmax's gradient y·(dy - Σ y·dy) from the output as the backward saves it,
  rounded to the inputs' dtype (as jax.nn's own derivative takes its output; here the
  nearest value), formed exactly and then rounded: the error that saving y allows. A
  dominant element's rounding enters Σ y·dy times dy, so how far the gradient lands
  depends on which way that y rounded; the reference in the inputs' dtype forms another
  y, and errs more or less by that luck (docs/testing.md)."""
  dtype = np.asarray(dy).dtype
  y = np.asarray(exact_y).astype(dtype).astype(np.float64)
  dy = np.asarray(dy, np.float64)
  return (y * (dy - np.sum(y * dy, axis=-1, keepdims=True))).astype(dtype)


def _inputs(key, shape, dtype, name, scale=4.0):
  kx, kd = jax.random.split(key)
  x = (scale * jax.random.normal(kx, shape)).astype(dtype)
  dy_shape = shape[:-1] if name == "logsumexp" else shape
  dy = jax.random.normal(kd, dy_shape).astype(dtype)
  return x, dy


def _dtype_name(dtype) -> str:
  return jnp.dtype(dtype).name


# The kernels' code depends on the dtype in two places only: exp (float32: jnp.exp;
# 16-bit: exp2 of x·log2(e), `rows.engine.exp_for`), taken by every variant, and the
# default tiling's stream blocks, sized in bytes (split-default). bfloat16 and float16
# run the same code and differ in rounding and range. So each (case, op) runs in one
# dtype, DTYPES[(case + op) % 3] (a Latin square, not the cube): every case still meets
# all three dtypes, every op all three, and every case every op.
INTERPRET_RUNS = [
    pytest.param(name, dtype, *case.values, id=f"{case.id}-{_dtype_name(dtype)}-{name}")
    for i, case in enumerate(INTERPRET_CASES) for j, name in enumerate(OPS)
    for dtype in [DTYPES[(i + j) % len(DTYPES)]]]


@pytest.mark.parametrize("name, dtype, shape, tiling", INTERPRET_RUNS)
def test_matches_truth_interpret(key, name, dtype, shape, tiling):
  _check(name, *_inputs(key, shape, dtype, name), tiling=tiling)


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape, tiling", GPU_CASES)
def test_matches_truth_gpu(key, name, dtype, shape, tiling):
  _check(name, *_inputs(key, shape, dtype, name), tiling=tiling, interpret=False)


MASK_CASES = [
    pytest.param((9, 300), None, id="resident"),
    pytest.param((9, 300), RowTiling("online", 4, 64), id="online"),
    pytest.param((3, 700), RowTiling("split", 2, 64, 2), id="split"),
]


def _mask(key, shape):
  where = jax.random.uniform(key, shape) > 0.3
  return where.at[1].set(False)  # one row masked entirely


# Each (variant, op) masked in one of this test's two dtypes, float32 and bfloat16 in turn
# (the exp of float32 and that of 16-bit inputs): every variant and every op meets both,
# and every variant every op. split-softmax in bfloat16 is the case that needed the
# saved-output form (docs/testing.md).
MASK_RUNS = [
    pytest.param(name, *case.values, dtype, id=f"{_dtype_name(dtype)}-{case.id}-{name}")
    for i, case in enumerate(MASK_CASES) for j, name in enumerate(OPS)
    for dtype in [(jnp.float32, jnp.bfloat16)[(i + j + 1) % 2]]]


@pytest.mark.parametrize("name, shape, tiling, dtype", MASK_RUNS)
def test_where(key, name, shape, tiling, dtype):
  kx, km = jax.random.split(key)
  x, dy = _inputs(kx, shape, dtype, name)
  _check(name, x, dy, where=_mask(km, shape), tiling=tiling)


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
def test_where_gpu(key, name):
  kx, km = jax.random.split(key)
  for shape in [(513, 3000), (3, 300_000)]:
    x, dy = _inputs(kx, shape, jnp.bfloat16, name)
    _check(name, x, dy, where=_mask(km, shape), interpret=False)


def _extreme(kind, key, dtype):
  """A (6, 50) input with one kind of extreme value."""
  big = 6e4 if dtype == jnp.float16 else 1e30
  x = 3 * jax.random.normal(key, (6, 50), jnp.float32)
  if kind == "huge":  # ±big next to ordinary values: exp underflows to exactly 0
    x = x.at[:, ::7].set(big).at[:, 3::7].set(-big)
  elif kind == "offset":  # lse ~ 1000: x - lse would lose 3 decimal digits
    x = x + 1000.0
  elif kind == "all-equal":
    x = jnp.full((6, 50), 3.0)
  elif kind == "neg-inf-entries":
    x = x.at[:, ::3].set(-jnp.inf)
  elif kind == "neg-inf-row":  # jax.nn gives NaN for softmax and -inf for logsumexp
    x = x.at[2].set(-jnp.inf)
  elif kind == "nan":  # a NaN spreads through its row only
    x = x.at[4, 17].set(jnp.nan)
  elif kind == "pos-inf-entry":  # softmax, log_softmax: NaN rows as jax.nn; logsumexp +inf
    x = x.at[1, 5].set(jnp.inf)
  return x.astype(dtype)


EXTREME_TILINGS = [
    pytest.param(None, id="resident"),
    pytest.param(RowTiling("online", 2, 16), id="online"),
    pytest.param(RowTiling("split", 4, 16, 2), id="split"),
]


EXTREME_KINDS = ["huge", "offset", "all-equal", "neg-inf-entries", "neg-inf-row", "nan",
                 "pos-inf-entry"]


# Each (variant, op) in two of the three dtypes, the one left out DTYPES[(variant + op +
# 2) % 3]: every variant and every op still meets each dtype twice (float16's own
# extremes, ±6e4, among them), and every pair of variant, op and dtype meets. Kept:
# resident-softmax in float32 and online-softmax in bfloat16, the tight spots of
# docs/testing.md.
EXTREME_RUNS = [
    pytest.param(name, tiling.values[0],
                 [d for k, d in enumerate(DTYPES) if k != (i + j + 2) % len(DTYPES)],
                 id=f"{tiling.id}-{name}")
    for i, tiling in enumerate(EXTREME_TILINGS) for j, name in enumerate(OPS)]


@pytest.mark.parametrize("name, tiling, dtypes", EXTREME_RUNS)
def test_extremes(key, name, tiling, dtypes):
  # Every kind of extreme input in one call, six rows each, each kind's rows checked on
  # their own: one interpreted run per dtype instead of one per kind.
  kx, kd = jax.random.split(key)
  for dtype in dtypes:
    x = jnp.concatenate([_extreme(kind, kx, dtype) for kind in EXTREME_KINDS])
    dy_shape = x.shape[:-1] if name == "logsumexp" else x.shape
    dy = jax.random.normal(kd, dy_shape).astype(dtype)
    _check(name, x, dy, tiling=tiling, row_blocks={
        f"{kind} {jnp.dtype(dtype).name}": slice(6 * i, 6 * (i + 1))
        for i, kind in enumerate(EXTREME_KINDS)})
    # And the same non-finite pattern as jax.nn, which the reference mirrors.
    got = OPS[name][0](x, axis=-1, tiling=tiling)
    expected = getattr(jax.nn, name)(x, axis=-1)
    np.testing.assert_array_equal(np.isnan(np.asarray(got, np.float32)),
                                  np.isnan(np.asarray(expected, np.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("kind", EXTREME_KINDS)
def test_extremes_gpu(key, name, kind):
  for dtype in DTYPES:
    x = jnp.tile(_extreme(kind, key, dtype), (1, 700))  # 35000 columns: split by default
    dy_shape = x.shape[:-1] if name == "logsumexp" else x.shape
    dy = jax.random.normal(key, dy_shape).astype(dtype)
    _check(name, x, dy, interpret=False)


def test_all_neg_inf_row_matches_jax_nn():
  # The all -inf row exactly as jax.nn gives it (NaN, -inf); the finite row beside it to
  # within float32 rounding: JAX 0.12.1's jax.nn.softmax rounds it one ulp away from
  # exp(x - max) / sum in float32, which ours and JAX 0.12.0's give.
  x = jnp.array([[-jnp.inf] * 5, [0.0, 1, 2, 3, 4]])
  for ours, theirs in [(js.softmax(x), jax.nn.softmax(x)),
                       (js.log_softmax(x), jax.nn.log_softmax(x)),
                       (js.logsumexp(x, axis=-1), jax.nn.logsumexp(x, axis=-1))]:
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_allclose(ours[1], theirs[1], rtol=2**-22)


def test_fully_masked_row_gives_zero_gradient():
  x = jnp.arange(12.0).reshape(3, 4)
  where = jnp.ones((3, 4), bool).at[1].set(False)
  for name in OPS:
    fn = lambda x: jnp.sum(jnp.where(where, OPS[name][0](x, axis=-1, where=where), 0) ** 2) \
        if name != "logsumexp" else jnp.sum(jnp.where(
            where.any(-1), OPS[name][0](x, axis=-1, where=where), 0) ** 2)
    g = jax.grad(fn)(x)
    np.testing.assert_array_equal(g[1], 0.0)
    assert np.isfinite(np.asarray(g)).all()


@pytest.mark.parametrize("name", OPS)
def test_check_grads(key, name):
  x = jax.random.normal(key, (3, 37), jnp.float32)
  kernel = functools.partial(OPS[name][0], axis=-1)
  check_grads(kernel, (x,), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)
  split = functools.partial(kernel, tiling=RowTiling("split", 2, 16, 1))
  check_grads(split, (x,), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def _masked_objective(name, fn, where):
  """A scalar of the op's outputs that leaves out what ``where`` masks (-inf there)."""
  def objective(x):
    y = fn(x, axis=-1, where=where)
    if where is not None:
      y = jnp.where(where.any(-1) if name == "logsumexp" else where, y, 0.0)
    return jnp.sum(jnp.sin(y) ** 2)
  return objective


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("name", OPS)
def test_forward_mode_and_second_order(key, name, masked, interpret=True):
  # jax.jvp, jacfwd, hessian and jvp-of-grad as jax.nn's (row 1 masked entirely).
  x = jax.random.normal(key, (3, 37), jnp.float32)
  where = None
  if masked:
    where = (jax.random.uniform(jax.random.fold_in(key, 1), x.shape) > 0.3).at[1].set(False)
  ours = _masked_objective(name, functools.partial(OPS[name][0], interpret=interpret), where)
  theirs = _masked_objective(name, getattr(jax.nn, name), where)
  assert_same_derivatives(ours, theirs, x,
                          hessian_at=x[:2, :9] if where is None else x)
  kernel = functools.partial(OPS[name][0], axis=-1, where=where, interpret=interpret)
  if where is None:  # masked outputs are -inf, which finite differences cannot take
    check_grads(kernel, (x[:2, :9],), order=2, modes=("fwd", "rev"), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("name", OPS)
def test_forward_mode_and_second_order_gpu(key, name, masked):
  test_forward_mode_and_second_order(key, name, masked, interpret=False)


@pytest.mark.parametrize("name", OPS)
def test_training_step_runs_one_kernel_each_way(name):
  # Reverse mode transposes the tangent map, whose kernel is the op's backward kernel,
  # from the residuals a custom_vjp would save: the forward kernel, then the backward.
  x = jnp.ones((8, 300), jnp.bfloat16)
  loss = lambda x: jnp.sum(OPS[name][0](x, axis=-1, interpret=True).astype(jnp.float32))
  backward = {"softmax": "softmax_bwd_resident", "log_softmax": "log_softmax_bwd_resident",
              "logsumexp": "logsumexp_bwd_map"}[name]
  assert kernel_names(jax.make_jaxpr(jax.grad(loss))(x).jaxpr) == [f"{name}_resident",
                                                                   backward]


def test_composes_with_jit_vmap_grad(key):
  x = jax.random.normal(key, (2, 3, 40))
  # Nested vmaps fold into rows (no extra grid dimensions).
  np.testing.assert_allclose(jax.vmap(jax.vmap(js.softmax))(x), jax.nn.softmax(x),
                             rtol=1e-6, atol=1e-7)
  # vmap over an unmapped mask, and of a gradient.
  where = jax.random.uniform(key, (40,)) > 0.5
  np.testing.assert_allclose(
      jax.vmap(lambda r: js.log_softmax(r, where=where))(x[0]),
      jax.nn.log_softmax(x[0], where=where), rtol=1e-6, atol=1e-6)
  loss = lambda f, x: jnp.sum(jnp.sin(f(x, axis=-1)))
  np.testing.assert_allclose(
      jax.jit(jax.vmap(jax.grad(functools.partial(loss, js.logsumexp))))(x),
      jax.vmap(jax.grad(functools.partial(loss, jax.nn.logsumexp)))(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, (0, 2), None, -2])
def test_axes(key, axis):
  x = jax.random.normal(key, (4, 5, 6))
  if axis is not None:
    np.testing.assert_allclose(js.softmax(x, axis=axis), jax.nn.softmax(x, axis=axis),
                               rtol=1e-6, atol=1e-7)
  for keepdims in (False, True):
    got = js.logsumexp(x, axis=axis, keepdims=keepdims)
    want = jax.nn.logsumexp(x, axis=axis, keepdims=keepdims)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("shape, axis", [((0,), -1), ((3, 0), -1), ((3, 0), 0), ((0, 4), -1),
                                         ((2, 0, 3), (1, 2))])
def test_empty_inputs_as_jax_nn(name, shape, axis):
  # Empty arrays (an empty reduced axis, or no rows) take the reference path.
  ours, theirs = OPS[name][0], getattr(jax.nn, name)
  x = jnp.zeros(shape)
  got, want = ours(x, axis=axis), theirs(x, axis=axis)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_array_equal(got, want)
  grad = jax.grad(lambda x: jnp.sum(ours(x, axis=axis)))(x)
  assert grad.shape == shape


@pytest.mark.parametrize("axis", [-1, (0, 2), None])
def test_logsumexp_b_and_return_sign_as_jax_nn(key, axis):
  x = jax.random.normal(key, (3, 4, 5))
  b = jax.random.normal(jax.random.fold_in(key, 1), (4, 5))  # signed weights, broadcast
  where = jax.random.uniform(jax.random.fold_in(key, 2), (3, 4, 5)) > 0.2
  for kwargs in (dict(b=jnp.abs(b)), dict(b=b), dict(b=b, return_sign=True),
                 dict(return_sign=True), dict(b=b, where=where, keepdims=True)):
    got = js.logsumexp(x, axis, **kwargs)  # broadcasts b itself
    full = {k: jnp.broadcast_to(v, x.shape) if k == "b" else v for k, v in kwargs.items()}
    want = jax.nn.logsumexp(x, axis, **full)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-6)  # NaN where a sum is negative, as jax.nn
  weights = jnp.broadcast_to(jnp.abs(b), x.shape)
  grad = lambda f: jax.grad(lambda x: jnp.sum(f(x, axis, b=weights)))(x)
  np.testing.assert_allclose(grad(js.logsumexp), grad(jax.nn.logsumexp), rtol=1e-6)
  # jax.nn's positional order: (a, axis, b, keepdims).
  np.testing.assert_allclose(js.logsumexp(x, -1, None, True),
                             jax.nn.logsumexp(x, -1, None, True), rtol=1e-6)


def test_float64_takes_reference_path(key):
  with jax.enable_x64(True):
    x = jax.random.normal(key, (3, 9), jnp.float64)
    assert js.softmax(x).dtype == jnp.float64
    np.testing.assert_allclose(js.softmax(x), jax.nn.softmax(x), rtol=1e-14)
    np.testing.assert_allclose(jax.grad(lambda x: js.logsumexp(x))(x),
                               jax.grad(lambda x: jax.nn.logsumexp(x))(x), rtol=1e-14)


def test_bad_input_names_the_argument():
  with pytest.raises(TypeError, match="x must have a real floating dtype.*int32"):
    js.softmax(jnp.arange(4))
  with pytest.raises(TypeError, match="x must have a real floating dtype.*complex"):
    js.logsumexp(jnp.ones(4, jnp.complex64))
  with pytest.raises(ValueError, match=r"axis 2 is out of range.*\(3, 4\)"):
    js.log_softmax(jnp.ones((3, 4)), axis=2)
  with pytest.raises(ValueError, match="repeats an axis"):
    js.softmax(jnp.ones((3, 4)), axis=(1, -1))
  with pytest.raises(ValueError, match=r"where of shape \(5,\).*\(3, 4\)"):
    js.softmax(jnp.ones((3, 4)), where=jnp.ones(5, bool))
  with pytest.raises(TypeError, match="where must be a boolean"):
    js.softmax(jnp.ones((3, 4)), where=jnp.ones((3, 4)))
  with pytest.raises(ValueError, match="block_cols=16 must be >= the row length 40"):
    js.softmax(jnp.ones((3, 40)), tiling=RowTiling("resident", 1, 16))
  with pytest.raises(ValueError, match="block_rows must be a power of two"):
    RowTiling("online", 3, 16)
  with pytest.raises(ValueError, match="variant must be one of"):
    RowTiling("fast")


def test_nan_propagates_never_hidden():
  x = jnp.ones((2, 100)).at[0, 50].set(jnp.nan)
  for name in OPS:
    y = np.asarray(OPS[name][0](x, axis=-1))
    assert np.isnan(y[0]).all() and np.isfinite(y[1]).all(), name


@pytest.mark.parametrize("shape, variant", [
    ((4096, 4096), "resident"), ((65536, 1024), "resident"), ((16384, 16384), "resident"),
    ((512, 262144), "online"), ((4096, 32768), "online"), ((4, 16777216), "split"),
    ((8, 4194304), "split"),
])
def test_default_tiling_picks_the_variant(shape, variant):
  tiling = default_tiling(*shape, jnp.float32, reduces=True)
  assert tiling.variant == variant
  if variant == "resident":
    assert tiling.block_cols >= shape[1]
  if variant == "split":  # enough programs to fill the GPU
    n_chunks = -(-shape[1] // (tiling.chunk_blocks * tiling.block_cols))
    assert shape[0] * n_chunks >= 2 * 132


@pytest.mark.parametrize("shape, dtype, variant", [
    ((64, 1000), jnp.float32, ("resident",)),
    ((4096, 32768), jnp.bfloat16, ("online",)),
    ((8, 4194304), jnp.bfloat16, ("split_stats", "split_map")),
], ids=["resident", "online", "split"])
def test_row_kernels_lower_for_cuda(as_if_on_an_h200, shape, dtype, variant):
  # The Triton kernels compile only on a GPU, but they lower for CUDA anywhere: this
  # catches Pallas API drift in the newest JAX on every CI run. Forward and backward of
  # each softmax-family op, on the variant the default tiling picks for the shape
  # (logsumexp: the statistics kernel of the split variant, and a map for its backward).
  x = jax.ShapeDtypeStruct(shape, dtype)
  for name, (op, _) in OPS.items():
    def forward_backward(x, op=op):
      y, vjp = jax.vjp(lambda x: op(x, interpret=False), x)
      return y, vjp(jnp.ones_like(y))[0]
    text = jax.jit(forward_backward).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    kernels = set(re.findall(r'name = \\?"([a-z_]+)', text))
    want = ({"logsumexp_split_stats", "logsumexp_bwd_map"} if name == "logsumexp" else
            {f"{name}{step}_{kernel}" for step in ("", "_bwd") for kernel in variant})
    assert kernels == want, name
