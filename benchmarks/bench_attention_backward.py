"""The attention backward alone on the GPU: our Hopper backward's two designs (dQ by
atomic adds from the dK/dV kernel, and the deterministic one with a dQ kernel of its
own), our Triton backward, and the peers' backwards, on the same inputs in one run.

    PYTHONPATH=. python3 benchmarks/bench_attention_backward.py --out benchmarks/results

Each row times the pullback of one forward: `jax.vjp` runs the forward once, outside the
timed call, and the jitted call takes its residuals and dO and returns (dq, dk, dv). So
the rows compare what a backward costs given the residuals its own forward saved.
FLOPs: 2.5x the forward's 4·B·N·T·S·H (halved when causal): the five tile products of
a FlashAttention backward counted against the forward's two. Errors: the largest of the
dq, dk, dv errors against the float64 truth on batch row 0 and the query heads of K/V
head 0, as in bench_attention.py. Shapes: bench_attention.py's head-dim-128 and 64 ones,
and head dim 256 (where our Hopper backward does not run: the Triton one does).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

import harness
from bench_attention import (OURS, TARGET_SHAPES, case_inputs, implementations,
                             vs_best_peer)
from jaxsoftmax import reference

SHAPES = TARGET_SHAPES
SMOKE_SHAPES = [((1, 64, 2, 1, 32, True), jnp.bfloat16)]
# Our rows: bench_attention's names, and what runs the backward of each.
OUR_ROWS = {f"{OURS} mosaic_gpu": "Hopper backward, dQ by atomic adds",
            f"{OURS} mosaic_gpu deterministic": "Hopper backward, dQ kernel",
            f"{OURS} triton": "Triton backward"}
PEERS = ("cudnn", "fa3", "tokamax mosaic")


def _pullback(vjp, do):
  return vjp(do)


def bench_shape(report: harness.Report, case, dtype):
  B, T, N, K, H, causal = case
  group = N // K
  part_q = lambda a: a[:1, :, :group]
  part_kv = lambda a: a[:1, :, :1]
  ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=causal)[0]
  (q, k, v, do), common, flops = case_inputs(case, dtype)

  def ref_grads(q, k, v, do):
    return jax.vjp(ref, q, k, v)[1](do)

  truth = harness.float64_truth(ref_grads, part_q(q), part_kv(k), part_kv(v), part_q(do))
  impls = implementations(N, K, H, causal)
  for name in (*OUR_ROWS, *PEERS):
    attention, why = impls[name]
    impl = f"{name} ({OUR_ROWS[name]})" if name in OUR_ROWS else name
    if attention is None:
      report.skip(impl=impl, mode="bwd", note=why, **common)
      continue
    try:
      _, vjp = jax.vjp(jax.jit(attention), q, k, v)
    except Exception as e:  # noqa: BLE001 - a peer that fails is a result, not a crash
      report.skip(impl=impl, mode="bwd", note=f"{type(e).__name__}: {str(e)[:160]}",
                  **common)
      continue
    report.measure(mode="bwd", impl=impl, fn=_pullback, arg_sets=[(vjp, do)],
                   flops=flops * 2.5, truth=truth,
                   compare=lambda g: (part_q(g[0]), part_kv(g[1]), part_kv(g[2])),
                   **common)
    del vjp


if __name__ == "__main__":
  harness.run("attention_backward", __doc__, SHAPES, SMOKE_SHAPES, bench_shape,
              lambda case, dtype: len(OUR_ROWS) + len(PEERS), unit="TFLOP/s",
              summary=vs_best_peer,
              flops_doc="2.5 · 4·B·N·T·S·H (halved when causal): the backward's")
