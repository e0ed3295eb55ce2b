"""layer_norm and rms_norm on the GPU beside XLA, Flax's modules, Pallas' own kernels and
the copy / read ceilings.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_norms.py --out benchmarks/results

Rows x columns: 4096x4096 float32, 16384x8192 bfloat16, 8192x16384 float32 and 65536x1024
bfloat16; each op plain and with the residual add ("+res": h = x + residual, y =
norm(h), both returned). Forward and forward + backward (the VJP for a random dy, and a
random cotangent of h with the residual). Minimum traffic in units of one (rows, C)
array: plain 2 (read x, write y) and 5 with the backward (read x and dy, write dx); with
the residual 4 and 8 (read h, dy and h's cotangent, write dx). Scale and bias are C
values: not counted. % is of the copy ceiling. 16-bit shapes also run with float32
scale and bias ("f32 params", Flax's default param_dtype; outputs in x's dtype).

``--modes`` may add "bwd": the backward alone from the residuals each forward saved
(`harness.pullbacks`), 3 arrays of traffic (4 with the residual), as a model pays it:
in "fwd+bwd" XLA may fuse the forward's passes into the backward's, which a model's
other layers between the two do not allow. "step" tests that in one jit: the norm's
output feeds ``z = y @ w`` (w: C x 128) and a loss 0.5·|z|², so dy = z @ wᵀ exists only
once y is made, as in a model. Its rows also time the two products (the same for every
implementation): compare their times; their % understates the norm's.

Implementations: ours; XLA (`jax.jit` of plain jnp, the residual add included); Flax's
`nnx.LayerNorm` / `nnx.RMSNorm` under `jax.jit`; Pallas' own `layer_norm` / `rms_norm`
(jax.experimental.pallas.ops.gpu; plain only).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp

import harness
import jaxsoftmax as js

SHAPES = [((4096, 4096), jnp.float32), ((16384, 8192), jnp.bfloat16),
          ((8192, 16384), jnp.float32), ((65536, 1024), jnp.bfloat16),
          ((32768, 4096), jnp.bfloat16)]
SMOKE_SHAPES = [((16, 300), jnp.float32)]  # also tune_norms' and profile_rows'
# This script's smoke run adds a 16-bit shape, for the float32-parameter rows.
BENCH_SMOKE_SHAPES = SMOKE_SHAPES + [((16, 300), jnp.bfloat16)]
EPS = 1e-6
STEP_WIDTH = 128  # the columns of w in "step" mode's y @ w


def _jnp_norm(x, scale, bias, residual, *, rms):
  """XLA's path: plain jnp, statistics in float32 (float64 for the truth), output in x's
  dtype."""
  h = x if residual is None else x + residual
  h32 = h.astype(jnp.promote_types(x.dtype, jnp.float32))
  if rms:
    y = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + EPS)
  else:
    mean = jnp.mean(h32, axis=-1, keepdims=True)
    y = (h32 - mean) * jax.lax.rsqrt(jnp.var(h32, axis=-1, keepdims=True) + EPS)
  y = y * scale[None, :]
  if bias is not None:
    y = y + bias[None, :]
  y = y.astype(x.dtype)
  return y if residual is None else (y, h)


def _ours(x, scale, bias, residual, *, rms):
  if rms:
    return js.rms_norm(x, scale, epsilon=EPS, residual=residual)
  return js.layer_norm(x, scale, bias, epsilon=EPS, residual=residual)


def _flax(x, scale, bias, residual, *, rms):
  """Flax's module computing in x's dtype, its parameters in scale's (float32 parameters
  with 16-bit activations: Flax's mixed precision, the params cast to x's dtype)."""
  from flax import nnx
  C = x.shape[-1]
  module = (nnx.RMSNorm(C, epsilon=EPS, dtype=x.dtype, param_dtype=scale.dtype,
                        rngs=nnx.Rngs(0))
            if rms else nnx.LayerNorm(C, epsilon=EPS, dtype=x.dtype, param_dtype=scale.dtype,
                                      rngs=nnx.Rngs(0)))
  module.scale[...] = scale
  if not rms:
    module.bias[...] = bias
  return module(x)


def _pallas(x, scale, bias, residual, *, rms):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from jax.experimental.pallas.ops.gpu import layer_norm, rms_norm
  op = rms_norm.rms_norm if rms else layer_norm.layer_norm
  # Its ops map a one-row kernel over exactly two leading axes (batch, sequence): x
  # gets a batch axis of one.
  y = op(x[None], scale, jnp.zeros_like(scale) if bias is None else bias, eps=EPS)
  return y[0]


def _differentiated(fn, residual: bool):
  """``fn(x, scale, bias, r)`` as a function of what is differentiated (see `_vjp`)."""
  return fn if residual else (lambda x, scale, bias: fn(x, scale, bias, None))


def _primals(residual: bool, x, scale, bias, r) -> tuple:
  """The arguments of `_differentiated`: r only with the residual."""
  return (x, scale, bias, r) if residual else (x, scale, bias)


def step_weight(shape, dtype):
  """The w of "step" mode's z = y @ w: (C, STEP_WIDTH), N(0, 1/C), so z is of order 1."""
  return (jax.random.normal(jax.random.PRNGKey(2), (shape[1], STEP_WIDTH))
          * shape[1] ** -0.5).astype(dtype)


def _vjp(fn, residual: bool):
  """The forward + backward of ``fn(x, scale, bias, r)`` for cotangents dy (and dh).
  Without the residual, r is not differentiated: its cotangent would be a (rows, C)
  array of zeros, a write of one more array that the op does not do."""
  def run(x, scale, bias, r, dy, dh):
    out, vjp = jax.vjp(_differentiated(fn, residual), *_primals(residual, x, scale, bias, r))
    return out, vjp((dy, dh) if residual else dy)
  return run


def _step(fn, residual: bool, w):
  """The forward + backward through the layer a model puts after the norm: z = y @ w and
  a loss 0.5·|z|² whose cotangent of z is z itself, so dy = z @ wᵀ exists only once y is
  made and multiplied, as in a model (with a given cotangent of z instead, dy would not
  depend on y and XLA could again fold the forward into the backward). With the
  residual, h's cotangent dh is given."""
  def through_w(x, scale, bias, r):
    out = fn(x, scale, bias, r)
    return (out[0] @ w, out[1]) if residual else out @ w

  def run(x, scale, bias, r, dh):
    out, vjp = jax.vjp(_differentiated(through_w, residual),
                       *_primals(residual, x, scale, bias, r))
    return out, vjp((out[0], dh) if residual else out)
  return run


def shape_inputs(report: harness.Report, shape, dtype):
  """The rotated input sets [x, residual, dy, dh] of a shape, its scale and bias, the
  bytes of one (rows, C) array, and the report fields with the copy ceiling (measured
  here, in the same run)."""
  C = shape[1]
  n_bytes = math.prod(shape) * jnp.dtype(dtype).itemsize
  keys = jax.random.split(jax.random.PRNGKey(0), harness.rotations(8 * n_bytes))
  sets = [[jax.random.normal(kk, shape, jnp.float32).astype(dtype)
           for kk in jax.random.split(k, 4)] for k in keys]
  kp = jax.random.split(jax.random.PRNGKey(1), 2)
  scale = (1 + 0.1 * jax.random.normal(kp[0], (C,))).astype(dtype)
  bias = (0.1 * jax.random.normal(kp[1], (C,))).astype(dtype)
  copy, _ = harness.measure_ceilings(report, [(s[0],) for s in sets], shape=shape,
                                     dtype=dtype)
  common = dict(shape=shape, dtype=jnp.dtype(dtype).name, ceiling_gbps=copy)
  return sets, scale, bias, n_bytes, common


def _backward_alone(fn, reference, residual: bool, sets, scale, bias) -> dict:
  """`Report.measure`'s fn, arg_sets and truth for the pullback alone."""
  primals = lambda s: _primals(residual, s[0], scale, bias, s[1])
  cotangent = lambda dy, dh: (dy, dh) if residual else dy
  call, residual_sets = harness.pullbacks(_differentiated(fn, residual),
                                          [primals(s) for s in sets])
  n = 3 + residual
  truth = harness.float64_truth(
      lambda *a: jax.vjp(_differentiated(reference, residual), *a[:n])[1](cotangent(*a[n:])),
      *primals(sets[0]), sets[0][2], sets[0][3])
  return dict(fn=lambda r, dy, dh: call(r, cotangent(dy, dh)),
              arg_sets=[(r, s[2], s[3]) for r, s in zip(residual_sets, sets)], truth=truth)


def _param_dtypes(dtype) -> tuple:
  """Parameter dtypes to measure: the activations', and for 16-bit activations also
  float32 (Flax's default param_dtype, as mixed-precision models keep them)."""
  return (dtype,) if jnp.dtype(dtype).itemsize == 4 else (dtype, jnp.float32)


def bench_shape(report: harness.Report, shape, dtype):
  sets, scale_x, bias_x, n_bytes, common = shape_inputs(report, shape, dtype)
  w = step_weight(shape, dtype)
  for param_dtype, rms in ((p, r) for p in _param_dtypes(dtype) for r in (False, True)):
    scale, bias = scale_x.astype(param_dtype), bias_x.astype(param_dtype)
    suffix = "" if param_dtype == dtype else " f32 params"
    name = "rms_norm" if rms else "layer_norm"
    b = None if rms else bias
    impls = {"jaxsoftmax": _ours, "xla": jax.jit(_jnp_norm, static_argnames="rms"),
             "flax nnx": _flax, "pallas": _pallas}
    if suffix:
      del impls["pallas"]  # its kernels take the parameters in x's dtype
    for residual in (False, True):
      op = name + (" +res" if residual else "") + suffix
      reference = functools.partial(_jnp_norm, rms=rms)
      for impl, fn in impls.items():
        if residual and impl in ("flax nnx", "pallas"):
          continue  # no fused residual there: XLA's row stands for adding it first
        fn = functools.partial(fn, rms=rms)
        if "fwd" in report.modes:
          fwd = lambda x, r, fn=fn: fn(x, scale, b, r if residual else None)
          truth = harness.float64_truth(lambda x, r: reference(x, scale, b,
                                                               r if residual else None),
                                        sets[0][0], sets[0][1])
          report.measure(op=op, impl=impl, mode="fwd", fn=fwd,
                         arg_sets=[(s[0], s[1]) for s in sets],
                         nbytes=(4 if residual else 2) * n_bytes, truth=truth, **common)
        if "fwd+bwd" in report.modes:
          both = _vjp(fn, residual)
          truth = harness.float64_truth(
              _vjp(reference, residual),
              sets[0][0], scale, b, sets[0][1], sets[0][2], sets[0][3])
          report.measure(op=op, impl=impl, mode="fwd+bwd",
                         fn=lambda x, r, dy, dh, both=both: both(x, scale, b, r, dy, dh),
                         arg_sets=[tuple(s) for s in sets],
                         nbytes=(8 if residual else 5) * n_bytes, truth=truth, **common)
        if "step" in report.modes:
          step = _step(fn, residual, w)
          truth = harness.float64_truth(
              lambda w, *a: _step(reference, residual, w)(*a),
              w, sets[0][0], scale, b, sets[0][1], sets[0][3])
          report.measure(op=op, impl=impl, mode="step",
                         fn=lambda x, r, dh, step=step: step(x, scale, b, r, dh),
                         arg_sets=[(s[0], s[1], s[3]) for s in sets],
                         nbytes=(8 if residual else 5) * n_bytes, truth=truth, **common)
        if "bwd" in report.modes:
          try:  # the forward runs here, outside measure: a peer that fails is a row
            alone = _backward_alone(fn, reference, residual, sets, scale, b)
          except Exception as e:  # noqa: BLE001
            report.skip(op=op, impl=impl, shape=shape, dtype=common["dtype"], mode="bwd",
                        note=harness.failure_note(e))
            continue
          report.measure(op=op, impl=impl, mode="bwd", **alone,
                         nbytes=(4 if residual else 3) * n_bytes, **common)


if __name__ == "__main__":
  harness.run("norms", __doc__, SHAPES, BENCH_SMOKE_SHAPES, bench_shape,
              lambda shape, dtype, modes: 2 + len(modes) * 2 * (
                  (4 + 2) + (3 + 2) * (len(_param_dtypes(dtype)) - 1)))
