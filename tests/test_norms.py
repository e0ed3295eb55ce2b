"""layer_norm and rms_norm: outputs and the gradients of x, residual, scale and bias
against the float64 truth under the 2x rule (docs/testing.md), on every kernel variant
of the row engine (interpreted on a CPU), with and without the fused residual add."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoftmax as js
from jaxsoftmax import RowTiling
from tolerance import assert_2x, truth

ON_GPU = jax.default_backend() == "gpu"
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TILINGS = [
    pytest.param(None, id="default"),
    pytest.param(RowTiling("online", 4, 64), id="online"),
    pytest.param(RowTiling("split", 2, 64, 2), id="split"),
]


def _reference(x, scale, bias, residual, *, rms, epsilon=1e-6, scale_offset=0.0):
  """Pure jnp in x's dtype (float64 for the truth)."""
  h = x if residual is None else (x + residual).astype(x.dtype)
  if rms:
    y = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + epsilon)
  else:
    mean = jnp.mean(h, axis=-1, keepdims=True)
    y = (h - mean) * jax.lax.rsqrt(jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
                                   + epsilon)
  column = lambda c: c.reshape((1,) * (y.ndim - 1) + c.shape)
  if scale is not None:
    y = y * column(scale + scale_offset)
  if bias is not None:
    y = y + column(bias)
  return y.astype(x.dtype), h


def _ours(x, scale, bias, residual, *, rms, tiling, **options):
  fn = js.rms_norm if rms else js.layer_norm
  extra = {} if rms else dict(bias=bias)
  out = fn(x, scale, residual=residual, tiling=tiling, interpret=not ON_GPU, **extra,
           **options)
  return out if residual is not None else (out, x)


def _inputs(key, shape, dtype, *, residual=True, mean=0.0, spread=1.0, param_dtype=None):
  kx, kr, ks, kb, ky, kh = jax.random.split(key, 6)
  x = (mean + spread * jax.random.normal(kx, shape)).astype(dtype)
  r = jax.random.normal(kr, shape).astype(dtype) if residual else None
  scale = (1 + 0.3 * jax.random.normal(ks, shape[-1:])).astype(param_dtype or dtype)
  bias = (0.3 * jax.random.normal(kb, shape[-1:])).astype(param_dtype or dtype)
  dy = jax.random.normal(ky, shape).astype(dtype)
  dh = jax.random.normal(kh, shape).astype(dtype)
  return x, r, scale, bias, dy, dh


def _check(x, r, scale, bias, dy, dh, *, rms, tiling=None, baseline_dtype=None, **options):
  """The 2x rule; ``baseline_dtype``: compute the reference whose error sets the bound in
  that dtype (then round it to x's), for inputs where x's own dtype overflows."""
  has_r = r is not None
  bias = None if rms else bias  # rms_norm has no bias

  def run(norm, x, r, scale, bias):
    def f(x, r, scale, bias):
      return norm(x, scale, bias, r, rms=rms, **options)
    (y, h), vjp = jax.vjp(f, x, r, scale, bias)
    grads = vjp((dy.astype(y.dtype), dh.astype(h.dtype) if has_r else jnp.zeros_like(h)))
    return (y, h, *grads)

  ours = functools.partial(_ours, tiling=tiling)
  got = jax.jit(functools.partial(run, ours))(x, r, scale, bias)
  if baseline_dtype is None:
    in_dtype = jax.jit(functools.partial(run, _reference))(x, r, scale, bias)
  else:
    cast = lambda a, t: None if a is None else a.astype(t)
    wide = jax.jit(functools.partial(run, _reference))(
        *(cast(a, baseline_dtype) for a in (x, r, scale, bias)))
    in_dtype = [cast(a, x.dtype) for a in wide]
  exact = truth(functools.partial(run, _reference), x, r, scale, bias)
  names = ("y", "h", "dx", "dresidual", "dscale", "dbias")
  for what, a, b, c in zip(names, got, in_dtype, exact):
    if a is None or (not has_r and what in ("h", "dresidual")):
      continue
    assert a.dtype == (scale.dtype if what in ("dscale", "dbias") else x.dtype), what
    assert_2x(a, b, c, what=what)


# The four kernels, (rms, residual): layer_norm and rms_norm, each with and without the
# fused residual add.
KINDS = [(False, False), (True, False), (False, True), (True, True)]


def _runs(tilings, dtypes):
  """(rms, dtype, tiling, residual) for every kind on every tiling, each pair in one dtype,
  dtypes[(tiling + kind) % len(dtypes)] (a Latin square, not the cube): every tiling and
  every kind still meets every dtype, and every kind every tiling."""
  return [pytest.param(rms, dtype, tiling.values[0], residual,
                       id=f"{('plain', 'residual')[residual]}-{tiling.id}-"
                          f"{jnp.dtype(dtype).name}-{('layer_norm', 'rms_norm')[rms]}")
          for i, tiling in enumerate(tilings) for j, (rms, residual) in enumerate(KINDS)
          for dtype in [dtypes[(i + j) % len(dtypes)]]]


# On (37, 300) the kernels' code depends on the dtype only through h (x + residual,
# rounded to x's dtype) and the dtype it loads and stores: the default tiles are the same
# for every dtype (`norms.api._forward_tiling`), and bfloat16 and float16 differ in
# rounding and range only. So one dtype per (tiling, kind), all three across each.
@pytest.mark.parametrize("rms, dtype, tiling, residual", _runs(TILINGS, DTYPES))
def test_matches_truth(key, rms, dtype, tiling, residual):
  _check(*_inputs(key, (37, 300), dtype, residual=residual), rms=rms, tiling=tiling)


# Both 16-bit dtypes take the same three-part parameters (`norms.api._param_parts`):
# bfloat16 and float16 in turn over (tiling, kind), each tiling and each kind in both,
# float16 without a residual (the bound a bfloat16 scale would miss) on both tilings.
@pytest.mark.parametrize("rms, dtype, tiling, residual",
                         _runs(TILINGS[:2], [jnp.bfloat16, jnp.float16]))
def test_float32_parameters(key, rms, dtype, tiling, residual):
  # Flax's mixed precision: 16-bit x, float32 scale and bias, which the kernels read in
  # three bfloat16 parts each (norms.api._bfloat16_parts). Without a residual, against
  # XLA's path (float32 math, rounded once), where a scale rounded to bfloat16 would miss
  # float16's bound; with one, against x's dtype (the float32 baseline would not round h).
  _check(*_inputs(key, (37, 300), dtype, residual=residual, param_dtype=jnp.float32),
         rms=rms, tiling=tiling, baseline_dtype=None if residual else jnp.float32)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("n_cols", [3000, 8000])
def test_float32_parameters_two_row_tiles(key, rms, n_cols):
  # The default forward tiles for float32 parameters beside 16-bit rows of 4096 and 8192
  # columns: two rows a program (norms.api._forward_tiling), an odd row count.
  _check(*_inputs(key, (5, n_cols), jnp.bfloat16, residual=False, param_dtype=jnp.float32),
         rms=rms, baseline_dtype=jnp.float32)


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("mean", [1e4, 3e5])
def test_large_mean_keeps_the_variance(key, tiling, mean):
  # A mean far above the unit spread: Σx² - n·mean² would lose the variance in float32;
  # merged Welford states keep it, their means taken from a shift near the data (from
  # zero, each tile's mean rounded at the data's magnitude, and dx missed the 2x rule).
  x, _, scale, bias, dy, _ = _inputs(key, (9, 1000), jnp.float32, residual=False,
                                     mean=mean)
  _check(x, None, scale, bias, dy, None, rms=False, tiling=tiling)


def test_constant_rows_and_gemma_offset(key):
  # Variance 0: y is the bias exactly; rms_norm with Gemma's (1 + scale).
  x = jnp.full((3, 50), 7.0)
  y = js.layer_norm(x, jnp.ones(50), jnp.arange(50.0), interpret=not ON_GPU)
  np.testing.assert_array_equal(y, jnp.broadcast_to(jnp.arange(50.0), (3, 50)))
  x, _, scale, _, dy, _ = _inputs(key, (5, 130), jnp.bfloat16, residual=False)
  _check(x, None, scale, None, dy, None, rms=True, scale_offset=1.0)


def test_huge_float16_values(key):
  # 2e4² overflows float16, where the reference in float16 gives NaN; the kernels'
  # statistics are float32: within 2x of the float32 computation rounded to float16.
  x, r, scale, bias, dy, dh = _inputs(key, (4, 256), jnp.float16, spread=2e4)
  _check(x, r, scale, bias, dy, dh, rms=False, baseline_dtype=jnp.float32)
  _check(x, r, scale, bias, dy, dh, rms=True, baseline_dtype=jnp.float32)


@pytest.mark.parametrize("n", [1, 7, 4097, 70001])
def test_row_lengths(key, n):
  x, r, scale, bias, dy, dh = _inputs(key, (3, n), jnp.bfloat16)
  _check(x, r, scale, bias, dy, dh, rms=False)


def test_no_scale_jit_vmap_and_axes(key):
  x = jax.random.normal(key, (2, 3, 40))
  ref = _reference(x, None, None, None, rms=False)[0]
  f = functools.partial(js.layer_norm, interpret=not ON_GPU)
  np.testing.assert_allclose(jax.jit(f)(x), ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jax.vmap(f)(x), ref, rtol=1e-5, atol=1e-5)
  moved = f(jnp.moveaxis(x, -1, 0), axis=0)
  np.testing.assert_allclose(jnp.moveaxis(moved, 0, -1), ref, rtol=1e-5, atol=1e-5)
  with jax.enable_x64(True):  # float64 takes the pure-jnp path
    x64 = x.astype(jnp.float64)
    np.testing.assert_allclose(js.rms_norm(x64), _reference(x64, None, None, None,
                                                            rms=True)[0], rtol=1e-12)


def test_bad_input():
  x = jnp.ones((4, 8))
  with pytest.raises(TypeError, match="layer_norm: x must have a real floating dtype"):
    js.layer_norm(jnp.ones((4, 8), jnp.int32))
  with pytest.raises(ValueError, match=r"rms_norm: scale must have the normalized axes' "
                                       r"shape \(8,\), got \(4,\)"):
    js.rms_norm(x, jnp.ones(4))
  with pytest.raises(ValueError, match="layer_norm: residual must have x's shape"):
    js.layer_norm(x, residual=jnp.ones((4, 9)))
  with pytest.raises(ValueError, match="epsilon must be a number >= 0"):
    js.layer_norm(x, epsilon=-1.0)


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_flax_nnx_parity(key, module, dtype):
  # Same constructor, same parameters: the same outputs and gradients as Flax's module
  # (bfloat16 inputs with float32 parameters promote to float32 in both).
  nnx = pytest.importorskip("flax.nnx")
  jsnnx = pytest.importorskip("jaxsoftmax.nnx")
  kx, kp, kd = jax.random.split(key, 3)
  x = jax.random.normal(kx, (6, 5, 96)).astype(dtype)
  ours, theirs = (getattr(m, module)(96, epsilon=1e-5, rngs=nnx.Rngs(0))
                  for m in (jsnnx, nnx))
  for m in (ours, theirs):  # the same non-trivial parameters in both
    m.scale[...] = 1 + 0.3 * jax.random.normal(kp, (96,))
    if module == "LayerNorm":
      m.bias[...] = 0.2 * jax.random.normal(kd, (96,))
  assert "pallas_call" in str(jax.make_jaxpr(lambda x: ours(x))(x))  # the kernel path
  y_ours, y_theirs = ours(x), theirs(x)
  assert y_ours.dtype == y_theirs.dtype == jnp.float32
  np.testing.assert_allclose(y_ours, y_theirs, rtol=2e-5, atol=2e-5)

  def loss(model, x):
    return jnp.sum(model(x) * jnp.cos(jnp.arange(96.0))[None, None, :])

  g_ours = nnx.grad(loss, argnums=(0, 1))(ours, x)
  g_theirs = nnx.grad(loss, argnums=(0, 1))(theirs, x)
  np.testing.assert_allclose(g_ours[1], g_theirs[1], rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(g_ours[0].scale[...], g_theirs[0].scale[...], rtol=2e-4,
                             atol=2e-4)
  # Flax's own code where the kernels do not apply: normalizing two axes, one feature axis.
  wide = jsnnx.LayerNorm(5, reduction_axes=(-2, -1), feature_axes=-2, rngs=nnx.Rngs(0))
  flax_wide = nnx.LayerNorm(5, reduction_axes=(-2, -1), feature_axes=-2, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(wide(x), flax_wide(x), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape, dtype", [
    ((1000, 4096), jnp.float32),  # resident
    ((65537, 33), jnp.bfloat16),  # many rows per program
    ((300, 40001), jnp.bfloat16),  # online
    ((3, 1_000_003), jnp.float16),  # split
], ids=["resident", "many-rows", "online", "split"])
def test_matches_truth_gpu(key, rms, shape, dtype):
  # The compiled kernels on the default tilings, with the residual add.
  _check(*_inputs(key, shape, dtype), rms=rms)


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape, dtype", [
    ((2001, 8000), jnp.bfloat16),  # layer_norm online; rms_norm 4 warps (2 rows in the
                                   # backward), 8 with the residual
    ((129, 16383), jnp.float32),  # layer_norm online; rms_norm 4 warps, 16 with residual
    ((4099, 1100), jnp.float16),  # one warp
], ids=["8000-bfloat16", "16383-float32", "1100-float16"])
def test_forward_tilings_gpu(key, rms, residual, shape, dtype):
  # The compiled forwards on their own default warps (few a row), rows and columns a
  # multiple of no tile.
  _check(*_inputs(key, shape, dtype, residual=residual), rms=rms)


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape, dtype", [
    ((2001, 8000), jnp.bfloat16), ((4099, 1100), jnp.float16), ((3, 1_000_003), jnp.bfloat16),
    ((3001, 4000), jnp.bfloat16),
], ids=["8000-bfloat16", "1100-float16", "split-bfloat16", "4000-bfloat16"])
def test_float32_parameters_gpu(key, rms, shape, dtype):
  # The compiled kernels reading float32 parameters in bfloat16 parts, on the default
  # tilings, against XLA's float32 path.
  _check(*_inputs(key, shape, dtype, residual=False, param_dtype=jnp.float32), rms=rms,
         baseline_dtype=jnp.float32)


def _norm_of(n_cols, dtype, *, rms=False, residual=False, param_parts=1):
  from jaxsoftmax.norms import api as norms
  return norms._Norm(rms, 1e-6, 0.0, n_cols, jnp.dtype(dtype).name, residual, True,
                     not rms, None, False, param_parts)


def test_forward_tiling_choice():
  # The forward's warps: values a thread holds by kind, only where a program holds one
  # whole row of 1024 columns or more; layer_norm's rows of 8192 columns and more in
  # halves (online, 8 warps); otherwise the rows' defaults.
  from jaxsoftmax.norms import api as norms
  from jaxsoftmax.rows import RowTiling, default_tiling

  def tiling(n_rows, n_cols, dtype, **kind):
    return norms._forward_tiling(_norm_of(n_cols, dtype, **kind), n_rows)

  warps = lambda *args, **kind: tiling(*args, **kind).num_warps
  assert tiling(16384, 8192, jnp.bfloat16) == RowTiling("online", 1, 4096, 1, 8)
  assert tiling(16384, 8000, jnp.bfloat16, residual=True) == RowTiling("online", 1, 4096,
                                                                        1, 8)
  assert tiling(8192, 16383, jnp.float32) == RowTiling("online", 1, 8192, 1, 8)
  assert warps(8192, 16384, jnp.float32, rms=True) == 4
  assert warps(16384, 8192, jnp.bfloat16, rms=True) == 4
  assert warps(16384, 8192, jnp.bfloat16, rms=True, residual=True) == 8
  assert warps(4096, 4096, jnp.float32) == 8 and warps(4096, 4096, jnp.bfloat16) == 2
  assert warps(65536, 1024, jnp.bfloat16) == warps(65536, 1000, jnp.bfloat16) == 1
  for n_rows, n_cols in ((37, 300), (300, 40001)):  # many rows a program; online
    assert tiling(n_rows, n_cols, jnp.float32) == default_tiling(n_rows, n_cols,
                                                                 jnp.float32, reduces=True)
  # float32 parameters (in bfloat16 parts) beside 16-bit rows of 4096 or 8192: two rows a
  # program, without a residual only.
  assert tiling(16384, 8192, jnp.bfloat16, param_parts=3) == RowTiling("online", 2, 4096,
                                                                       1, 8)
  assert tiling(32768, 4096, jnp.bfloat16, param_parts=3) == RowTiling("online", 2, 2048,
                                                                       1, 4)
  assert tiling(32768, 3000, jnp.bfloat16, rms=True, param_parts=3) == RowTiling(
      "resident", 2, 4096, 1, 16)
  assert tiling(32768, 4096, jnp.bfloat16, residual=True, param_parts=3) == tiling(
      32768, 4096, jnp.bfloat16, residual=True)
  assert tiling(16384, 5000, jnp.float16, rms=True, param_parts=3) == RowTiling(
      "resident", 2, 8192, 1, 16)
  assert tiling(16384, 8192, jnp.bfloat16, residual=True, param_parts=3) == tiling(
      16384, 8192, jnp.bfloat16, residual=True)
  assert tiling(1, 8192, jnp.bfloat16, param_parts=3) == tiling(1, 8192, jnp.bfloat16)
  assert tiling(65536, 1024, jnp.bfloat16, param_parts=3) == tiling(65536, 1024,
                                                                     jnp.bfloat16)


def test_backward_tiling_choice():
  # Two rows a program only for rms_norm's 16-bit rows of 8192 columns, no residual.
  from jaxsoftmax.norms import api as norms
  from jaxsoftmax.rows import default_tiling

  rows = lambda n_rows, n_cols, dtype, **kind: norms._backward_tiling(
      _norm_of(n_cols, dtype, **kind), n_rows).block_rows
  assert rows(16384, 8192, jnp.bfloat16, rms=True) == rows(9, 5000, jnp.float16, rms=True) == 2
  assert rows(16384, 8192, jnp.bfloat16) == 1
  assert rows(16384, 8192, jnp.bfloat16, rms=True, residual=True) == 1
  assert rows(8192, 8192, jnp.float32, rms=True) == rows(1, 8192, jnp.bfloat16, rms=True) == 1
  assert rows(8192, 4096, jnp.bfloat16, rms=True) == rows(8192, 16384, jnp.bfloat16,
                                                           rms=True) == 1
  norm = _norm_of(300, jnp.bfloat16, rms=True)
  assert norms._backward_tiling(norm, 37) == default_tiling(37, 300, jnp.bfloat16,
                                                            reduces=True)


def _rows_for_three_blocks(block_rows: int) -> int:
  """Rows that make each program of the resident column-sum kernel walk three row blocks
  of ``block_rows``, the last program's last block past the rows (for blocks small
  enough to get the most programs per SM)."""
  from jaxsoftmax._core.pallas import num_cores
  from jaxsoftmax.rows.engine import COL_SUM_PROGRAMS_PER_CORE
  return (2 * COL_SUM_PROGRAMS_PER_CORE[1] * num_cores() + 1) * block_rows - 1


def test_engine_column_sums(key):
  # The row engine's column sums: each program of the resident variant walks several row
  # blocks (3 of 2 rows, the last block past the rows), and XLA adds the programs'
  # partial sums.
  from jaxsoftmax.rows import RowOp, row_call
  x = jax.random.normal(key, (_rows_for_three_blocks(2), 100))
  op = RowOp("col_sums_test", sums={"total": lambda t: t.x.x},
             apply=lambda t, stats: t.x.x - stats.total / 100,
             col_sums={"total": lambda t: t.x.x, "squares": lambda t: t.x.x * t.x.x})
  out, stats, col_sums = row_call(op, (x,), tiling=RowTiling("resident", 2, 128),
                                  interpret=not ON_GPU)
  row_sum, (col_sum, col_squares) = stats.total, col_sums
  np.testing.assert_allclose(out, x - x.mean(axis=1, keepdims=True), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(row_sum, x.sum(axis=1), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(col_sum, x.sum(axis=0), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(col_squares, (x * x).sum(axis=0), rtol=1e-5, atol=1e-4)
  # Rows streamed in column blocks, and resident rows too wide for a thread to carry
  # the sums (two of 4096 columns on 4 warps: 64 a thread): no column sums from the
  # kernels.
  col_sums = row_call(op, (x,), tiling=RowTiling("online", 4, 64), interpret=not ON_GPU).col_sums
  assert col_sums.total is None and col_sums.squares is None
  col_sums = row_call(op, (x[:5],), tiling=RowTiling("resident", 1, 4096, 1, 4),
                      interpret=not ON_GPU).col_sums
  assert col_sums.total is None


def test_vmap_of_gradients(key):
  # Under vmap the column sums (dscale, dbias) stay per batch element.
  x, _, scale, bias, _, _ = _inputs(key, (3, 7, 50), jnp.float32, residual=False)
  loss = lambda x, scale, bias: jnp.sum(jnp.sin(
      js.layer_norm(x, scale, bias, interpret=not ON_GPU)))
  grads = jax.vmap(jax.grad(loss, argnums=(1, 2)), in_axes=(0, None, None))(x, scale, bias)
  for i in range(3):
    one = jax.grad(loss, argnums=(1, 2))(x[i], scale, bias)
    for a, b in zip(grads, one):
      np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_programs_walking_several_row_blocks(key, rms):
  # One-row blocks, three a program (the last past the rows): dscale and dbias from the
  # kernel's partial column sums.
  _check(*_inputs(key, (_rows_for_three_blocks(1), 50), jnp.bfloat16), rms=rms,
         tiling=RowTiling("resident", 1, 64))


def test_wide_resident_rows_take_xla_column_sums(key):
  # A resident tile too wide for a thread to carry its column sums (two sums of 4096
  # columns on 4 warps: 64 a thread) leaves dscale and dbias to XLA's sums.
  _check(*_inputs(key, (5, 3000), jnp.float32), rms=False,
         tiling=RowTiling("resident", 1, 4096, 1, 4))


@pytest.mark.parametrize("tiling, kernels", [
    (None, {"layer_norm_resident", "layer_norm_bwd_resident_col_sums"}),
    (RowTiling("split", 2, 1024, 3), {f"layer_norm{step}_split_{kernel}"
                                      for step in ("", "_bwd") for kernel in ("stats", "map")}),
], ids=["resident-col-sums", "split"])
def test_norm_kernels_lower_for_cuda(as_if_on_an_h200, tiling, kernels):
  # layer_norm with scale, bias and the residual, forward and backward, lowers for CUDA
  # without a GPU: Pallas API drift shows on every CI run.
  def step(x, r, scale, bias):
    loss = lambda *a: jnp.sum(js.layer_norm(a[0], a[2], a[3], residual=a[1], tiling=tiling,
                                            interpret=False)[0])
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, r, scale, bias)
  rows, cols = jax.ShapeDtypeStruct((300, 4096), jnp.bfloat16), jax.ShapeDtypeStruct(
      (4096,), jnp.bfloat16)
  text = jax.jit(step).trace(rows, rows, cols, cols).lower(lowering_platforms=("cuda",))
  assert set(re.findall(r'name = \\?"(layer_norm[a-z_]*)', text.as_text())) == kernels
