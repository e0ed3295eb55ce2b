"""FlashAttention forward and forward + backward on the GPU beside XLA, cuDNN, Pallas'
own `mha`, FlashAttention-3 and tokamax, in one run on the same inputs.

    PYTHONPATH=. python3 benchmarks/bench_attention.py --out benchmarks/results

Shapes: DESIGN §8's, a GQA case (32 query heads on 8 K/V heads), and one long causal
sequence (B1 T32768). bfloat16 inputs. FLOPs: 4·B·N·T·S·H, halved when causal; forward +
backward counts 3.5x that. Errors are against the float64 truth on batch row 0 and the
query heads of K/V head 0 (heads are independent, and the truth of a whole T32768 problem
would not fit in memory): forward, the output; forward + backward, the largest of the
dq, dk, dv errors for the cotangent dO ~ N(0, 1). Peak MiB: what XLA's buffer assignment
gives the compiled call besides its inputs (the O(T·S) logits of XLA show there).

A peer that is absent (FA3 and tokamax travel as wheels, see ../shared/peers) or fails on
a shape gets a row saying so, never a crash.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

import harness
import jaxsoftmax as js
from jaxsoftmax import reference

# (B, T, N, K, H, causal): T == S; K the K/V heads.
SHAPES = [((4, 4096, 16, 16, 128, False), jnp.bfloat16),
          ((4, 4096, 16, 16, 128, True), jnp.bfloat16),
          ((1, 16384, 16, 16, 128, False), jnp.bfloat16),
          ((1, 16384, 16, 16, 128, True), jnp.bfloat16),
          ((8, 2048, 16, 16, 64, False), jnp.bfloat16),
          ((2, 8192, 16, 16, 256, False), jnp.bfloat16),
          ((4, 4096, 32, 8, 128, True), jnp.bfloat16),
          ((1, 32768, 16, 16, 128, True), jnp.bfloat16)]
SMOKE_SHAPES = [((1, 64, 2, 1, 32, True), jnp.bfloat16)]

# XLA's logits and probabilities are O(B·N·T·S); past this many elements it is not timed
# (its peak memory is still recorded from the compiled program).
XLA_MAX_LOGITS = 2**32


def _peer_pallas():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from jax.experimental.pallas.ops.gpu import attention
  return attention


def implementations(N: int, K: int, H: int, causal: bool):
  """name -> (attention(q, k, v), None) or (None, why it is not measured)."""
  scale = H ** -0.5
  impls = {
      "jaxsoftmax": (functools.partial(js.dot_product_attention, is_causal=causal), None),
      "xla": (functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                implementation="xla"), None),
      "cudnn": (functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                  implementation="cudnn"), None),
  }
  try:
    mha = _peer_pallas().mha

    def pallas_mha(q, k, v):
      # Pallas' mha has no GQA: the user repeats the K/V heads (timed with it).
      k, v = (jnp.repeat(a, N // K, axis=2) for a in (k, v))
      return mha(q, k, v, None, sm_scale=scale, causal=causal)

    impls["pallas mha"] = (pallas_mha, None)
  except ImportError as e:
    impls["pallas mha"] = (None, f"not importable: {e}")
  try:
    import flash_attn3_jax
    impls["fa3"] = (functools.partial(flash_attn3_jax.flash_mha, softmax_scale=scale,
                                      is_causal=causal), None)
  except ImportError as e:
    impls["fa3"] = (None, f"wheel absent: {e}")
  try:
    import tokamax
    impls["tokamax mosaic"] = (functools.partial(tokamax.dot_product_attention,
                                                 is_causal=causal, implementation="mosaic"),
                               None)
  except ImportError as e:
    impls["tokamax mosaic"] = (None, f"wheel absent: {e}")
  return impls


def _fwd_bwd(attention):
  """q, k, v, dO -> (dq, dk, dv): the forward and the backward, as a training step runs."""
  def run(q, k, v, do):
    _, vjp = jax.vjp(attention, q, k, v)
    return vjp(do)
  return run


def case_inputs(case, dtype):
  """(q, k, v, dO) of a case, the report fields naming it, and its forward FLOPs."""
  B, T, N, K, H, causal = case
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (B, T, N, H), dtype)
  k = jax.random.normal(keys[1], (B, T, K, H), dtype)
  v = jax.random.normal(keys[2], (B, T, K, H), dtype)
  do = jax.random.normal(keys[3], (B, T, N, H), dtype)
  common = dict(op="attention" + (" causal" if causal else ""), shape=(B, T, N, K, H),
                dtype=jnp.dtype(dtype).name)
  return (q, k, v, do), common, 4 * B * N * T * T * H / (2 if causal else 1)


def bench_shape(report: harness.Report, case, dtype):
  B, T, N, K, H, causal = case
  group = N // K
  (q, k, v, do), common, flops = case_inputs(case, dtype)

  # The truth on batch row 0 and the query heads of K/V head 0.
  part_q = lambda a: a[:1, :, :group]
  part_kv = lambda a: a[:1, :, :1]
  ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=causal)[0]
  truth_fwd = harness.float64_truth(ref, part_q(q), part_kv(k), part_kv(v))
  truth_bwd = harness.float64_truth(_fwd_bwd(ref), part_q(q), part_kv(k), part_kv(v),
                                    part_q(do))
  compare_bwd = lambda g: (part_q(g[0]), part_kv(g[1]), part_kv(g[2]))

  too_big = B * N * T * T > XLA_MAX_LOGITS
  for name, (attention, why) in implementations(N, K, H, causal).items():
    for mode in ("fwd", "fwd+bwd"):
      if attention is None:
        report.skip(impl=name, mode=mode, note=why, **common)
        continue
      fn, args = (attention, (q, k, v)) if mode == "fwd" else (_fwd_bwd(attention),
                                                                (q, k, v, do))
      if name == "xla" and too_big:
        try:
          peak = f"{harness.peak_memory_mib(fn, *args):.0f} MiB"
        except Exception as e:  # noqa: BLE001 - compiling may fail for lack of memory too
          peak = f"{type(e).__name__}"
        report.skip(impl=name, mode=mode, note=f"not timed: O(T·S) logits; compiled peak "
                    f"{peak}", **common)
        continue
      report.measure(mode=mode, impl=name, fn=fn, arg_sets=[args],
                     flops=flops * (1 if mode == "fwd" else 3.5),
                     truth=truth_fwd if mode == "fwd" else truth_bwd,
                     compare=part_q if mode == "fwd" else compare_bwd, **common)


if __name__ == "__main__":
  harness.run("attention", __doc__, SHAPES, SMOKE_SHAPES, bench_shape,
              lambda case, dtype: 12, unit="TFLOP/s")
