"""Cross-entropy with integer labels on the GPU beside optax and the copy / read ceilings.

    PYTHONPATH=. python3 benchmarks/bench_cross_entropy.py --out benchmarks/results

Minimum traffic for T rows of V logits of b bytes: forward T·V·b (read the logits once),
forward + backward 3·T·V·b (read them in each pass, write the gradient). % is of the read
ceiling for the forward and of the copy ceiling for forward + backward.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import optax

import harness
import jaxsoftmax as js
from jaxsoftmax.cross_entropy import reference

SHAPES = [((8192, 131072), jnp.bfloat16), ((16384, 32000), jnp.bfloat16)]
SMOKE_SHAPES = [((16, 1000), jnp.bfloat16)]

IMPLS = {
    "jaxsoftmax": lambda x, y: js.cross_entropy(x, y),
    "optax": lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y).mean(),
}


def bench_shape(report: harness.Report, shape, dtype):
  rows, classes = shape
  itemsize = jnp.dtype(dtype).itemsize
  n_bytes = rows * classes * itemsize
  keys = jax.random.split(jax.random.PRNGKey(0), 2 * harness.rotations(n_bytes))
  sets = [((3 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype),
           jax.random.randint(ky, (rows,), 0, classes)) for kx, ky in zip(keys[::2], keys[1::2])]
  common = dict(shape=shape, dtype=jnp.dtype(dtype).name)
  x_sets = [(x,) for x, _ in sets]
  copy, read = harness.measure_ceilings(report, x_sets, shape=shape, dtype=dtype)
  ref = lambda x, y: reference.cross_entropy(x, y)
  truth_fwd = harness.float64_truth(ref, *sets[0])
  truth_both = harness.float64_truth(jax.value_and_grad(ref), *sets[0])
  for impl, fn in IMPLS.items():
    report.measure(op="cross_entropy", impl=impl, mode="fwd", fn=fn, arg_sets=sets,
                   nbytes=n_bytes + rows * 4, truth=truth_fwd, ceiling_gbps=read,
                   ceiling="read", **common)
  for impl, fn in IMPLS.items():
    report.measure(op="cross_entropy", impl=impl, mode="fwd+bwd", fn=jax.value_and_grad(fn),
                   arg_sets=sets, nbytes=3 * n_bytes + rows * 4, truth=truth_both,
                   ceiling_gbps=copy, **common)


if __name__ == "__main__":
  harness.run("cross_entropy", __doc__, SHAPES, SMOKE_SHAPES, bench_shape,
              lambda shape, dtype, modes: 2 + 2 * len(IMPLS))
