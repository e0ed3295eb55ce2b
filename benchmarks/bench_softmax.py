"""softmax, log_softmax and logsumexp on the GPU beside XLA, Pallas' own softmax and the
copy / read ceilings: square, tall, wide and very long rows in float32 and bfloat16.

    PYTHONPATH=. python3 benchmarks/bench_softmax.py --out benchmarks/results

Minimum traffic (N elements of b bytes): forward softmax / log_softmax 2·N·b (read x,
write y), logsumexp N·b; forward + backward 5·N·b (forward, then read y or x and dy,
write dx). % is of the copy ceiling, or of the read ceiling for logsumexp.

``--modes`` picks among "fwd", "fwd+bwd" (the default two) and "bwd": the backward alone
from the residuals each forward saved (`harness.pullbacks`), 3·N·b, as a model pays it.
In "fwd+bwd" XLA may fuse the forward's passes into the backward's; a `custom_vjp`
cannot, and neither can XLA where other layers run between the two.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp

import harness
import jaxsoftmax as js
from jaxsoftmax.softmax import reference

SHAPES = [
    ((4096, 4096), jnp.float32),
    ((16384, 16384), jnp.float32),
    ((65536, 1024), jnp.float32),
    ((32768, 8192), jnp.bfloat16),
    ((4096, 32768), jnp.bfloat16),
    ((512, 262144), jnp.float32),
    ((4, 16777216), jnp.float32),
    ((8, 4194304), jnp.bfloat16),
]
SMOKE_SHAPES = [((8, 300), jnp.float32), ((2, 5000), jnp.bfloat16)]
OPS = ("softmax", "log_softmax", "logsumexp")
# Pallas' own softmax holds a whole row in one block: longer rows exhaust registers.
PALLAS_MAX_COLS = 32768


def _pallas_softmax():
  with warnings.catch_warnings():  # importing it warns that it is deprecated
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import softmax as pallas_ops_softmax
  return lambda x, axis: pallas_ops_softmax.softmax(x, axis=axis)


def _forward(fn):
  return lambda x: fn(x, axis=-1)


def _forward_backward(fn):
  def run(x, dy):
    y, vjp = jax.vjp(lambda x: fn(x, axis=-1), x)
    return y, vjp(dy)[0]
  return run


def bench_shape(report: harness.Report, shape, dtype):
  n = math.prod(shape)
  itemsize = jnp.dtype(dtype).itemsize
  name = jnp.dtype(dtype).name
  keys = jax.random.split(jax.random.PRNGKey(0), 2 * harness.rotations(n * itemsize))
  xs = [(4 * jax.random.normal(k, shape, jnp.float32)).astype(dtype) for k in keys[::2]]
  dys = [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys[1::2]]
  x_sets = [(x,) for x in xs]
  common = dict(shape=shape, dtype=name)

  copy, read = harness.measure_ceilings(report, x_sets, shape=shape, dtype=dtype)

  for op in OPS:
    ours, xla, ref = getattr(js, op), getattr(jax.nn, op), getattr(reference, op)
    impls = [("jaxsoftmax", ours), ("xla (jax.nn)", xla)]
    if op == "softmax" and shape[-1] <= PALLAS_MAX_COLS:
      impls.append(("pallas ops softmax", _pallas_softmax()))
    is_lse = op == "logsumexp"
    nbytes = n * itemsize + (shape[0] * itemsize if is_lse else n * itemsize)
    if "fwd" in report.modes:
      truth = harness.float64_truth(_forward(ref), xs[0])
      for impl, fn in impls:
        report.measure(op=op, impl=impl, mode="fwd", fn=_forward(fn), arg_sets=x_sets,
                       nbytes=nbytes, truth=truth, ceiling_gbps=read if is_lse else copy,
                       ceiling="read" if is_lse else "copy", **common)
    if is_lse:
      continue
    if "fwd+bwd" in report.modes:
      truth = harness.float64_truth(_forward_backward(ref), xs[0], dys[0])
      for impl, fn in impls[:2]:
        report.measure(op=op, impl=impl, mode="fwd+bwd", fn=_forward_backward(fn),
                       arg_sets=list(zip(xs, dys)), nbytes=5 * n * itemsize, truth=truth,
                       ceiling_gbps=copy, **common)
    if "bwd" in report.modes:
      truth = harness.float64_truth(lambda x, dy: jax.vjp(_forward(ref), x)[1](dy)[0],
                                    xs[0], dys[0])
      for impl, fn in impls[:2]:
        call, residual_sets = harness.pullbacks(_forward(fn), x_sets)
        report.measure(op=op, impl=impl, mode="bwd",
                       fn=lambda r, dy, call=call: call(r, dy)[0],
                       arg_sets=list(zip(residual_sets, dys)), nbytes=3 * n * itemsize,
                       truth=truth, ceiling_gbps=copy, **common)


def _rows(shape, dtype, modes):
  pallas = shape[-1] <= PALLAS_MAX_COLS
  # ceilings; forward: softmax (+ Pallas), log_softmax, logsumexp; each backward mode:
  # softmax and log_softmax, ours and XLA's
  return 2 + ("fwd" in modes) * (2 + pallas + 2 + 2) + 4 * len({"fwd+bwd", "bwd"} & set(modes))


if __name__ == "__main__":
  harness.run("softmax", __doc__, SHAPES, SMOKE_SHAPES, bench_shape, _rows)
