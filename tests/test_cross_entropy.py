"""cross_entropy: forward, lse and gradients against the float64 truth, and optax."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import jaxsoftmax as js
from jaxsoftmax.cross_entropy import reference
from jaxsoftmax.softmax import reference as softmax_reference
from jaxsoftmax.rows import RowTiling
from tolerance import assert_2x, assert_same_derivatives, truth

# (rows, classes, tiling): the path each one exercises.
INTERPRET_CASES = [
    pytest.param(13, 10, None, id="many-rows"),  # 10 classes, 8 rows per program
    pytest.param(9, 1000, RowTiling("online", 2, 128), id="online-ragged"),
    pytest.param(3, 4097, RowTiling("split", 1, 256, 3), id="split-ragged"),
    pytest.param(4, 20000, None, id="split-default"),
]
GPU_CASES = [
    pytest.param(1000, 1000, None, id="resident"),
    pytest.param(600, 32000, None, id="online-default"),
    pytest.param(3, 262_147, None, id="split-default"),  # a 256k vocabulary, ragged
]
OPTIONS = [
    pytest.param({}, id="plain"),
    pytest.param(dict(label_smoothing=0.1, z_loss=1e-3), id="smoothing-zloss"),
]


def _inputs(key, rows, classes, dtype, offset=0.0):
  kx, ky, kg, kl = jax.random.split(key, 4)
  logits = (offset + 3 * jax.random.normal(kx, (rows, classes))).astype(dtype)
  labels = jax.random.randint(ky, (rows,), 0, classes).at[1 % rows].set(-100)  # one ignored
  g = jax.random.normal(kg, (rows,))
  g_lse = jax.random.normal(kl, (rows,))
  return logits, labels, g, g_lse


def _check(logits, labels, g, g_lse, options, tiling=None, interpret=True, where=None):
  """Per-row loss and lse, and the gradient of <g, loss> + <g_lse, lse>."""

  def run(loss_and_lse, logits, g, g_lse):
    def objective(x):
      loss, lse = loss_and_lse(x)
      return jnp.sum(g * loss) + jnp.sum(g_lse * lse), (loss, lse)
    grad, (loss, lse) = jax.grad(objective, has_aux=True)(logits)
    return loss, lse, grad

  # One call for both, as users ask for the lse: two calls would each round their part
  # of the gradient to the logits' dtype and autodiff would add the two parts in that
  # dtype, a rounding the kernel does not make (up to 0.71 ulps in float16 at seed 3).
  kernel = functools.partial(js.cross_entropy, labels=labels, where=where,
                             reduction="none", return_lse=True, tiling=tiling,
                             interpret=interpret, **options)
  got = jax.jit(functools.partial(run, kernel))(logits, g, g_lse)

  def ref_run(logits, g, g_lse):
    def loss_and_lse(x):
      loss = reference.cross_entropy(x, labels, where=where, reduction="none", **options)
      return loss, softmax_reference.logsumexp(x, axis=-1, where=where)
    return run(loss_and_lse, logits, g, g_lse)

  in_dtype = jax.jit(ref_run)(logits, g.astype(logits.dtype), g_lse.astype(logits.dtype))
  exact = truth(ref_run, logits, g, g_lse)
  assert got[0].dtype == jnp.float32 and got[2].dtype == logits.dtype
  for what, a, b, c in zip(("loss", "lse", "gradient"), got, in_dtype, exact):
    assert_2x(a, b, c, what=f"cross_entropy {what}")


# The kernels' code depends on the dtype in two places only: exp (float32: jnp.exp;
# 16-bit: exp2 of x·log2(e), `rows.engine.exp_for`), in every variant, and the default
# tiling's stream blocks, sized in bytes (split-default); bfloat16 and float16 run the
# same code and differ in rounding and range. Label smoothing changes the forward kernel
# (a row input and a sum). So each case runs both options, one in float32 and the other
# in a 16-bit dtype, and each option meets all three dtypes. online-ragged in float16
# with smoothing is the case that made the test call the op once (docs/testing.md).
INTERPRET_RUNS = [
    pytest.param(*case.values, dtype, options.values[0],
                 id=f"{case.id}-{jnp.dtype(dtype).name}-{options.id}")
    for case, dtypes in zip(INTERPRET_CASES, [(jnp.float32, jnp.bfloat16),
                                              (jnp.float32, jnp.float16),
                                              (jnp.bfloat16, jnp.float32),
                                              (jnp.float16, jnp.float32)])
    for options, dtype in zip(OPTIONS, dtypes)]


@pytest.mark.parametrize("rows, classes, tiling, dtype, options", INTERPRET_RUNS)
def test_matches_truth_interpret(key, rows, classes, tiling, dtype, options):
  _check(*_inputs(key, rows, classes, dtype), options, tiling)


@pytest.mark.gpu
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows, classes, tiling", GPU_CASES)
def test_matches_truth_gpu(key, rows, classes, tiling, dtype, options):
  _check(*_inputs(key, rows, classes, dtype), options, tiling, interpret=False)


# Every variant masked, without and with the z-loss in turn: the z-loss is a coefficient
# of the backward map (whose tiling is the map's default, whatever the forward's) and a
# term of jnp in the forward, so it meets the mask in no variant's own code.
WHERE_OPTIONS = [pytest.param({}, id="plain"), pytest.param(dict(z_loss=1e-3), id="zloss")]
WHERE_RUNS = [
    pytest.param(*case.values, options.values[0], id=f"{case.id}-{options.id}")
    for i, case in enumerate(INTERPRET_CASES) for options in [WHERE_OPTIONS[i % 2]]]


@pytest.mark.parametrize("rows, classes, tiling, options", WHERE_RUNS)
def test_where_matches_truth_interpret(key, rows, classes, tiling, options):
  # Masked logits leave the normalizer, labels included; row 2 is masked entirely.
  logits, labels, g, g_lse = _inputs(key, rows, classes, jnp.float32)
  where = jax.random.uniform(jax.random.fold_in(key, 1), (rows, classes)) > 0.3
  where = where.at[2].set(False)
  _check(logits, labels, g, g_lse, options, tiling, where=where)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, classes, tiling", GPU_CASES)
def test_where_matches_truth_gpu(key, rows, classes, tiling):
  logits, labels, g, g_lse = _inputs(key, rows, classes, jnp.bfloat16)
  where = jax.random.uniform(jax.random.fold_in(key, 1), (rows, classes)) > 0.3
  _check(logits, labels, g, g_lse, {}, tiling, interpret=False, where=where.at[2].set(False))


@pytest.mark.parametrize("axis, where_shape", [
    pytest.param(-1, None, id="last"), pytest.param(1, None, id="middle"),
    pytest.param((1, 2), None, id="two-axes"), pytest.param((2, 1), None, id="two-reversed"),
    pytest.param(-1, "logits", id="where-logits"), pytest.param(1, "rows", id="where-rows"),
    pytest.param((1, 2), "logits", id="two-axes-where")])
def test_axis_and_where_match_optax(key, axis, where_shape):
  kx, ky, kw = jax.random.split(key, 3)
  logits = 3 * jax.random.normal(kx, (4, 6, 5))
  axes = (axis,) if isinstance(axis, int) else axis
  n_classes = int(np.prod([logits.shape[a] for a in axes]))
  batch = tuple(d for a, d in enumerate(logits.shape) if a not in [b % 3 for b in axes])
  labels = jax.random.randint(ky, batch, 0, n_classes)
  where = None
  if where_shape == "logits":
    where = (jax.random.uniform(kw, logits.shape) > 0.3).at[0].set(False)
  elif where_shape == "rows":
    where = (jax.random.uniform(kw, batch) > 0.3).at[0].set(False)
  ours = lambda x: js.cross_entropy(x, labels, axis, where, reduction="none")
  theirs = lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels, axis, where)
  np.testing.assert_allclose(ours(logits), theirs(logits), rtol=1e-5, atol=1e-6)
  total = lambda f: jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(logits)
  got, want = total(ours), total(theirs)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  if where is not None:  # the mean leaves the rows with no logit left out
    active = jnp.any(jnp.broadcast_to(where if where.ndim == 3
                                      else jnp.expand_dims(where, axes), logits.shape),
                     axis=axes)
    np.testing.assert_allclose(js.cross_entropy(logits, labels, axis, where),
                               jnp.sum(theirs(logits)) / jnp.sum(active), rtol=1e-5)


def test_large_logits_keep_float32_accuracy(key):
  # lse ~ 1000: the loss is formed from differences to the row maximum.
  _check(*_inputs(key, 6, 300, jnp.float32, offset=1000.0),
         dict(label_smoothing=0.2), RowTiling("online", 2, 64))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_optax(key, reduction):
  kx, ky, kw = jax.random.split(key, 3)
  logits = jax.random.normal(kx, (2, 7, 50))
  labels = jax.random.randint(ky, (2, 7), 0, 50)
  optax_loss = lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels)
  reduce = dict(mean=jnp.mean, sum=jnp.sum, none=lambda v: v)[reduction]
  ours = lambda x: js.cross_entropy(x, labels, reduction=reduction)
  np.testing.assert_allclose(ours(logits), reduce(optax_loss(logits)), rtol=2e-6)
  # A random cotangent of its own, not one computed from each loss (sin of it): the
  # loss's last bit, which the check above allows to differ, would move that cotangent
  # by as much and fail the check below (seed 1: a loss of 4.86 one ulp apart).
  weights = jax.random.uniform(kw, jnp.shape(ours(logits)), minval=-1.0, maxval=1.0)
  total = lambda f: lambda x: jnp.sum(weights * f(x))
  np.testing.assert_allclose(jax.grad(total(ours))(logits),
                             jax.grad(total(lambda x: reduce(optax_loss(x))))(logits),
                             rtol=1e-5, atol=1e-7)


def test_label_smoothing_matches_optax_smooth_labels(key):
  kx, ky = jax.random.split(key)
  logits = jax.random.normal(kx, (5, 30))
  labels = jax.random.randint(ky, (5,), 0, 30)
  targets = optax.smooth_labels(jax.nn.one_hot(labels, 30), 0.3)
  np.testing.assert_allclose(
      js.cross_entropy(logits, labels, label_smoothing=0.3, reduction="none"),
      optax.softmax_cross_entropy(logits, targets), rtol=2e-6)


def test_ignored_rows(key):
  logits = jax.random.normal(key, (4, 12))
  labels = jnp.array([3, -100, 5, -100])
  kept = jnp.array([0, 2])
  loss = js.cross_entropy(logits, labels)
  np.testing.assert_allclose(
      loss, js.cross_entropy(logits[kept], labels[kept]), rtol=1e-6)  # mean over 2 rows
  grad = jax.grad(lambda x: js.cross_entropy(x, labels))(logits)
  np.testing.assert_array_equal(grad[1], 0.0)
  np.testing.assert_array_equal(grad[3], 0.0)
  all_ignored = jnp.full((4,), -100)
  assert js.cross_entropy(logits, all_ignored) == 0.0
  np.testing.assert_array_equal(jax.grad(lambda x: js.cross_entropy(x, all_ignored))(logits), 0)
  custom = js.cross_entropy(logits, jnp.array([3, 7, 5, 7]), ignore_index=7, reduction="sum")
  np.testing.assert_allclose(custom, 2 * loss, rtol=1e-6)


def test_out_of_range_labels():
  logits = jnp.zeros((3, 5))
  with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\).*5 at index \(1,\)"):
    js.cross_entropy(logits, jnp.array([0, 5, 1]))
  with pytest.raises(ValueError, match="-3 at index"):
    js.cross_entropy(logits, jnp.array([0, 1, -3]))
  # Inside jit the labels cannot be checked: the row's loss and gradient are NaN.
  labels = jnp.array([0, 5, 1])
  loss = jax.jit(lambda x, y: js.cross_entropy(x, y, reduction="none"))(logits, labels)
  assert np.isnan(loss[1]) and np.isfinite(loss[jnp.array([0, 2])]).all()
  grad = jax.jit(jax.grad(lambda x, y: js.cross_entropy(x, y, reduction="sum")))(logits, labels)
  assert np.isnan(grad[1]).all() and np.isfinite(grad[jnp.array([0, 2])]).all()


def test_nan_logits_propagate():
  logits = jnp.zeros((2, 8)).at[0, 3].set(jnp.nan)
  loss = js.cross_entropy(logits, jnp.array([1, 2]), reduction="none")
  assert np.isnan(loss[0]) and np.isfinite(loss[1])


def test_positive_infinite_logit_as_optax():
  # A row holding +inf: a loss of +inf, NaN where the label is the +inf logit (optax's
  # lse - label logit), its lse +inf; the other rows untouched.
  logits = jnp.zeros((3, 8)).at[0, 3].set(jnp.inf).at[1, 2].set(jnp.inf)
  labels = jnp.array([1, 2, 2])
  f = lambda x: js.cross_entropy(x, labels, reduction="none", return_lse=True)
  loss, lse = f(logits)
  want = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  np.testing.assert_array_equal(np.asarray(loss), np.asarray(want))
  assert (lse[:2] == jnp.inf).all() and np.isfinite(lse[2])
  grad = jax.grad(lambda x: jnp.sum(f(x)[0]))(logits)
  assert np.isnan(grad[:2]).any(axis=1).all() and np.isfinite(grad[2]).all()


def test_check_grads(key):
  logits = jax.random.normal(key, (5, 33))
  labels = jnp.array([0, 32, 7, -100, 3])
  for options in ({}, dict(label_smoothing=0.1, z_loss=0.01)):
    f = lambda x: js.cross_entropy(x, labels, return_lse=True, **options)
    check_grads(f, (logits,), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "where"])
def test_forward_mode_and_second_order(key, masked, interpret=True):
  # jax.jvp, jacfwd, hessian and jvp-of-grad as optax's (row 2 masked entirely), and
  # check_grads of both modes to second order with smoothing, z-loss and an ignored row.
  kx, ky, kw = jax.random.split(key, 3)
  logits = 2 * jax.random.normal(kx, (5, 13))
  labels = jax.random.randint(ky, (5,), 0, 13)
  where = (jax.random.uniform(kw, (5, 13)) > 0.3).at[2].set(False) if masked else None
  ours = lambda x: jnp.sum(jnp.sin(js.cross_entropy(x, labels, where=where,
                                                    reduction="none", interpret=interpret)))
  theirs = lambda x: jnp.sum(jnp.sin(
      optax.softmax_cross_entropy_with_integer_labels(x, labels, where=where)))
  assert_same_derivatives(ours, theirs, logits)
  options = dict(z_loss=1e-2) if masked else dict(label_smoothing=0.1, z_loss=1e-2)
  f = lambda x: js.cross_entropy(x, labels.at[3].set(-100), where=where, reduction="none",
                                 interpret=interpret, **options)
  check_grads(f, (logits,), order=2, modes=("fwd", "rev"), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "where"])
def test_forward_mode_and_second_order_gpu(key, masked):
  test_forward_mode_and_second_order(key, masked, interpret=False)


def test_composes_with_vmap_and_jit(key):
  logits = jax.random.normal(key, (3, 4, 20))
  labels = jax.random.randint(key, (3, 4), 0, 20)
  per_batch = jax.jit(jax.vmap(lambda x, y: js.cross_entropy(x, y)))(logits, labels)
  np.testing.assert_allclose(
      per_batch, optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(-1),
      rtol=2e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_rows(reduction):
  # An empty batch takes the reference path: no losses, and a mean of 0 (the mean over
  # no active row, as for an all-ignored batch).
  logits, labels = jnp.zeros((0, 7)), jnp.zeros((0,), jnp.int32)
  loss = js.cross_entropy(logits, labels, reduction=reduction)
  assert loss.shape == ((0,) if reduction == "none" else ())
  if reduction != "none":
    assert float(loss) == 0.0
  grad = jax.grad(lambda x: jnp.sum(js.cross_entropy(x, labels, reduction=reduction)))
  assert grad(logits).shape == (0, 7)


def test_float64_takes_reference_path(key):
  with jax.enable_x64(True):
    logits = jax.random.normal(key, (3, 9), jnp.float64)
    labels = jnp.array([1, 2, 3])
    np.testing.assert_allclose(
        js.cross_entropy(logits, labels),
        optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), rtol=1e-14)


def test_bad_input_names_the_argument():
  logits, labels = jnp.zeros((3, 5)), jnp.zeros(3, jnp.int32)
  with pytest.raises(TypeError, match="logits must have a real floating dtype"):
    js.cross_entropy(jnp.zeros((3, 5), jnp.int32), labels)
  with pytest.raises(TypeError, match="labels must be integers, got float32"):
    js.cross_entropy(logits, jnp.zeros(3))
  with pytest.raises(ValueError, match=r"labels of shape \(4,\).*\(3,\)"):
    js.cross_entropy(logits, jnp.zeros(4, jnp.int32))
  with pytest.raises(ValueError, match="reduction must be one of"):
    js.cross_entropy(logits, labels, reduction="avg")
  with pytest.raises(ValueError, match="label_smoothing must lie in"):
    js.cross_entropy(logits, labels, label_smoothing=1.5)
  with pytest.raises(ValueError, match="z_loss must be >= 0"):
    js.cross_entropy(logits, labels, z_loss=-1.0)
  with pytest.raises(ValueError, match="non-empty class axis"):
    js.cross_entropy(jnp.zeros((3, 0)), labels)
  with pytest.raises(ValueError, match=r"axis 2 is out of range.*\(3, 5\)"):
    js.cross_entropy(logits, labels, axis=2)
  with pytest.raises(TypeError, match="axis must be an int or a tuple"):
    js.cross_entropy(logits, labels, axis=[1])
  with pytest.raises(TypeError, match="where must be a boolean"):
    js.cross_entropy(logits, labels, where=jnp.ones((3, 5)))
  with pytest.raises(ValueError, match=r"where of shape \(3, 4\) does not broadcast"):
    js.cross_entropy(logits, labels, where=jnp.ones((3, 4), bool))
  with pytest.raises(ValueError, match="label_smoothing spreads the target"):
    js.cross_entropy(logits, labels, where=jnp.ones((3, 5), bool), label_smoothing=0.1)
