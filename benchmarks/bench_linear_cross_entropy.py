"""Fused linear + cross-entropy against the unfused matmul + loss, on the GPU.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_linear_cross_entropy.py --out DIR

Rows x hidden x vocabulary at T = 8192, H = 4096, V = 131072 and at Gemma 2 2B's
T = 8192, H = 2304, V = 256000 in bfloat16, and at T = 4096, H = 2048, V = 32768 in
float32: the loss (fwd) and `jax.value_and_grad` of the mean loss with respect to hidden
and weight (fwd+bwd), for
`linear_cross_entropy` (its default: on a Hopper GPU, for bfloat16, the "mosaic_gpu"
backend: the Mosaic GPU forward and the chunked backward, whose ds comes from the Hopper
dlogits kernel; for float32 the "xla_chunks" backend; `implementation="xla_chunks"`:
XLA's products chunk by chunk, forward and backward; `implementation="triton"`: the
Triton forward and the chunked backward with ds from XLA's float32 logits; chunks of
1024 columns; for bfloat16, forward + backward, chunks of 4096 columns),
for `x @ w` then optax's loss (XLA's own logits in the inputs' dtype: the program a user
writes), for `jnp.dot` with `preferred_element_type=float32` rounded to the inputs' dtype
then our `cross_entropy` or optax's (XLA keeps the float32 product: 2x the logits'
memory in bfloat16), and for `jnp.dot` with float32 logits then optax's (in float32 the
same as `dot + optax`). Peak MiB
is XLA's temporaries + outputs of the compiled call: the memory beyond the inputs that
the target bounds by 1.1x the gradients' size. Errors: the loss and both gradients
against the float64 truth, the largest over them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import harness
import jaxsoftmax as js
from jaxsoftmax.cross_entropy import reference

# New shapes go at the end: run_gpu.sh's LCE_ONLY (--only) picks shapes by index. The
# float32 shape measures "xla_chunks", float32's default on a GPU (the Hopper kernels
# take bfloat16 and float16 only, and Triton's float32 products run off the tensor
# cores), beside the Triton backend and the unfused loss.
SHAPES = [((8192, 4096, 131072), jnp.bfloat16), ((8192, 2304, 256000), jnp.bfloat16),
          ((4096, 2048, 32768), jnp.float32)]
SMOKE_SHAPES = [((37, 40, 301), jnp.float32)]


FLOPS_DOC = ("2·T·H·V for the loss and 6·T·H·V for loss and gradients (the products an "
             "unfused step needs; the fused backward recomputes the logits, a fourth "
             "product it does not count, and for float32 through Triton a fifth, for each "
             "row's softmax state)")


def _logits(x, w, dtype):
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype)


# The portable backend: the Triton forward, and the chunked backward with each chunk's ds
# formed by XLA (float32 logits, then an elementwise pass) instead of the Hopper dlogits
# kernel. On a Hopper GPU the default replaces it for bfloat16, and for float32 the
# xla_chunks backend does (Triton runs float32 only where it is named).
TRITON = "jaxsoftmax fused, Triton fwd + XLA ds"
# Half the default chunk at T = 8192 (2**23 logits): the memory / time trade of the
# chunked backward, whose peak is the gradients + a float32 dhidden + one chunk.
_CHUNK_1024 = js.LinearCrossEntropyTiling(chunk_vocab=1024)
IMPLS = {
    "jaxsoftmax fused": lambda x, w, y: js.linear_cross_entropy(x, w, y),
    TRITON: lambda x, w, y: js.linear_cross_entropy(x, w, y, implementation="triton"),
    "jaxsoftmax xla_chunks": lambda x, w, y: js.linear_cross_entropy(
        x, w, y, implementation="xla_chunks"),
    "jaxsoftmax fused chunk 1024": lambda x, w, y: js.linear_cross_entropy(
        x, w, y, tiling=_CHUNK_1024),
    "dot + jaxsoftmax ce": lambda x, w, y: js.cross_entropy(_logits(x, w, x.dtype), y),
    # The plain program a user writes (the XLA baseline): XLA's matmul gives
    # logits in the inputs' dtype directly.
    "x @ w + optax": lambda x, w, y: optax.softmax_cross_entropy_with_integer_labels(
        x @ w, y).mean(),
    "dot + optax": lambda x, w, y: optax.softmax_cross_entropy_with_integer_labels(
        _logits(x, w, x.dtype), y).mean(),
    "dot f32 + optax": lambda x, w, y: optax.softmax_cross_entropy_with_integer_labels(
        _logits(x, w, jnp.float32), y).mean(),
}
# bfloat16, forward + backward: the default at chunks of 4096 columns (without a float32
# chunk of logits, twice the chunk costs only its bfloat16 ds, and the chunk's products
# grow toward cuBLAS's whole-matrix speed).
BACKWARD_IMPLS = {
    "jaxsoftmax fused chunk 4096": lambda x, w, y: js.linear_cross_entropy(
        x, w, y, tiling=js.LinearCrossEntropyTiling(chunk_vocab=4096)),
}


def shape_inputs(shape, dtype):
  """hidden x (T, H), weight w (H, V) scaled to unit-variance logits, labels y (T,)."""
  T, H, V = shape
  kx, kw, ky = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (T, H), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (H, V), jnp.float32) * H ** -0.5).astype(dtype)
  return x, w, jax.random.randint(ky, (T,), 0, V)


def ref(x, w, y):
  """The reference loss, for the float64 truth."""
  return reference.cross_entropy(jnp.dot(x, w), y)


def bench_shape(report: harness.Report, shape, dtype):
  T, H, V = shape
  x, w, y = shape_inputs(shape, dtype)
  common = dict(op="linear_cross_entropy", shape=shape, dtype=jnp.dtype(dtype).name)
  both = lambda fn: jax.value_and_grad(fn, argnums=(0, 1))
  truth = {"fwd": harness.float64_truth(ref, x, w, y),
           "fwd+bwd": harness.float64_truth(both(ref), x, w, y)}
  flops = {"fwd": 2 * T * H * V, "fwd+bwd": 6 * T * H * V}
  for mode in report.modes:
    impls = dict(IMPLS)
    if mode == "fwd+bwd" and dtype == jnp.bfloat16:
      impls.update(BACKWARD_IMPLS)
    for impl, fn in impls.items():
      report.measure(mode=mode, impl=impl, fn=fn if mode == "fwd" else both(fn),
                     arg_sets=[(x, w, y)], flops=flops[mode], truth=truth[mode], **common)


if __name__ == "__main__":
  harness.run("linear_cross_entropy", __doc__, SHAPES, SMOKE_SHAPES, bench_shape,
              lambda shape, dtype, modes: (2 * len(IMPLS)
                                           + len(BACKWARD_IMPLS) * (dtype == jnp.bfloat16)),
              unit="TFLOP/s", flops_doc=FLOPS_DOC)
