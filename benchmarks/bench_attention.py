"""FlashAttention forward and forward + backward on the GPU: our two backends beside cuDNN,
Pallas' own `mha` and `attention_mgpu`, FlashAttention-3 and tokamax, in one run on the
same inputs.

    PYTHONPATH=. python3 benchmarks/bench_attention.py --out benchmarks/results

Shapes: the ones our targets name (B,T,N,H = 4,4096,16,128 and 1,16384,16,128, full and
causal; 8,2048,16,64; 2,8192,16,256), a GQA case (32 query heads on 8 K/V heads), a head
dim that is no multiple of 64 (96: the Mosaic GPU kernel pads it), and one long causal
sequence (B1 T32768), and a value head dim of its own (Hv = 128 under H = 192, as
DeepSeek's MLA attends), full and causal; then (--only 11,12,13) head dim 64 causal, the
GQA case without a mask, and 32 query heads on 4 K/V heads causal at 2x8192. bfloat16
inputs; Pallas' `attention_mgpu` takes
only float16, so float16 rows of it, ours and cuDNN stand beside them where it runs (no
GQA, H a multiple of 64, Hv = H). FLOPs: 2·B·N·T·S·(H + Hv) (4·B·N·T·S·H where Hv = H),
halved when causal; forward + backward counts 3.5x that.
Errors are against the float64 truth on batch row 0 and the query heads of K/V head 0
(heads are independent, and the truth of a whole T32768 problem would not fit in
memory): forward, the output; forward + backward, the largest of the dq, dk, dv errors
for the cotangent dO ~ N(0, 1). Peak MiB: what XLA's buffer assignment gives the compiled
call besides its inputs. `--modes fwd` measures the forward alone.

XLA's own attention (`implementation="xla"`, O(T·S) memory) is left out of this run to
fit the device's time.

A peer that is absent (FA3 and tokamax travel as wheels in .peers, see run_gpu.sh) or fails on
a shape gets a row saying so, never a crash. FA3 also runs through its varlen entry
points, with and without its deterministic backward (`fa3 varlen`, `fa3 varlen
deterministic`), beside our `deterministic=True`. The table ends with each shape's ratio of
ours to the fastest peer whose errors are finite (`vs_best_peer`). ATTN_ROWS
(comma-separated row names, e.g. "jaxsoftmax mosaic_gpu,cudnn,fa3") keeps only those rows,
in both dtypes, so that every target row fits one command on the GPU machine, and times
them in that order; BENCH_ROUNDS=2 times a shape's rows in two rounds, the second in the
reverse order (`harness.Report.measure_rounds`), so that none of them is always timed
last.
HOPPER_FWD_SCHEDULES (comma-separated, e.g. "dynamic,persistent") adds a row of ours for
each, "jaxsoftmax mosaic_gpu dynamic", whose Hopper forward takes its default tiles
(`HopperBlockSizes.default` for an unknown count of (batch row, head) pairs) with the
+-joined flags of FORWARD_FLAGS set ("static": those tiles as they are), and whose
backward is the default: a forward schedule timed alone and under a gradient beside the
default and the peers in one run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import harness
import jaxsoftmax as js
from jaxsoftmax.attention import HopperBlockSizes, reference

# (B, T, N, K, H, causal[, Hv]): T == S; K the K/V heads; Hv the value head dim where it
# is not H. The shapes the speed targets name
# (head dims 128, 64 and 256), which the tuning and backward benchmarks share.
TARGET_SHAPES = [((4, 4096, 16, 16, 128, False), jnp.bfloat16),
                 ((4, 4096, 16, 16, 128, True), jnp.bfloat16),
                 ((1, 16384, 16, 16, 128, False), jnp.bfloat16),
                 ((1, 16384, 16, 16, 128, True), jnp.bfloat16),
                 ((8, 2048, 16, 16, 64, False), jnp.bfloat16),
                 ((2, 8192, 16, 16, 256, False), jnp.bfloat16)]
# MLA's head dims (Hv = 128 under H = 192), causal and full.
MLA_SHAPES = [((4, 4096, 16, 16, 192, True, 128), jnp.bfloat16),
              ((4, 4096, 16, 16, 192, False, 128), jnp.bfloat16)]
# The targets' other rows: causal head dim 64, GQA without a mask, and GQA of 8 query
# heads a K/V head.
MORE_TARGET_SHAPES = [((8, 2048, 16, 16, 64, True), jnp.bfloat16),
                      ((4, 4096, 32, 8, 128, False), jnp.bfloat16),
                      ((2, 8192, 32, 4, 128, True), jnp.bfloat16)]
# Issue 31's other value head dims: V narrower and wider than Q/K, causal.
VALUE_DIM_SHAPES = [((4, 4096, 16, 16, 128, True, 64), jnp.bfloat16),
                    ((4, 4096, 16, 16, 64, True, 128), jnp.bfloat16)]
SHAPES = TARGET_SHAPES + [((4, 4096, 32, 8, 128, True), jnp.bfloat16),
                          ((4, 4096, 16, 16, 96, False), jnp.bfloat16),
                          ((1, 32768, 16, 16, 128, True), jnp.bfloat16),
                          *MLA_SHAPES, *MORE_TARGET_SHAPES, *VALUE_DIM_SHAPES]
SMOKE_SHAPES = [((1, 64, 2, 1, 32, True), jnp.bfloat16)]
OURS = "jaxsoftmax"  # the prefix of our rows' impl names


def _pallas_ops():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from jax.experimental.pallas.ops.gpu import attention, attention_mgpu
  return attention, attention_mgpu


# HOPPER_FWD_SCHEDULES' flags: the `HopperBlockSizes` fields each one sets.
FORWARD_FLAGS = {"persistent": dict(persistent=True),
                 "dynamic": dict(persistent=True, dynamic_schedule=True),
                 # the default's tiles without claimed items, as a call of fewer
                 # (batch row, head) pairs than `HopperBlockSizes.default` claims at
                 "static": dict(dynamic_schedule=False),
                 "stages3": dict(num_stages=3),
                 # 64-key blocks: MLA's before its default took 128-key ones
                 "kv64": dict(block_kv=64)}


def forward_schedules(H: int, causal: bool,
                      Hv: int | None = None) -> dict[str, HopperBlockSizes]:
  """Row suffix -> the Hopper forward's tiles of each of HOPPER_FWD_SCHEDULES at head dim
  ``H`` (the larger of the query's and the value's) and the values' ``Hv`` where it
  differs, as the kernel's own default takes them: the default's, with its flags set."""
  schedules = {}
  for spec in filter(None, os.environ.get("HOPPER_FWD_SCHEDULES", "").split(",")):
    unknown = set(spec.split("+")) - set(FORWARD_FLAGS)
    if unknown:
      raise ValueError(f"unknown forward flags {sorted(unknown)} in {spec!r}; known: "
                       f"{sorted(FORWARD_FLAGS)}")
    fields = {k: v for flag in spec.split("+") for k, v in FORWARD_FLAGS[flag].items()}
    schedules[spec] = dataclasses.replace(
        HopperBlockSizes.default(H, causal, value_head_dim=Hv), **fields)
  return schedules


def implementations(N: int, K: int, H: int, causal: bool, Hv: int | None = None):
  """name -> (attention(q, k, v), None) or (None, why it is not measured); ``Hv``: the
  value head dim where it is not ``H``."""
  scale = H ** -0.5
  ours = functools.partial(js.dot_product_attention, is_causal=causal)
  impls = {
      f"{OURS} mosaic_gpu": (functools.partial(ours, implementation="mosaic_gpu"), None),
      **{f"{OURS} mosaic_gpu {spec}": (functools.partial(
          ours, implementation="mosaic_gpu", block_sizes=blocks), None)
         for spec, blocks in forward_schedules(
             max(H, Hv or H), causal, Hv if Hv not in (None, H) else None).items()},
      f"{OURS} triton": (functools.partial(ours, implementation="triton"), None),
      # Bit-identical gradients: the Hopper backward with a dQ kernel of its own (the
      # Triton backward above head dim 128).
      f"{OURS} mosaic_gpu deterministic": (
          functools.partial(ours, implementation="mosaic_gpu", deterministic=True), None),
      "cudnn": (functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                  implementation="cudnn"), None),
  }
  try:
    mha = _pallas_ops()[0].mha

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
    # FA3's deterministic backward is reached through its varlen entry points only
    # (flash_mha fixes deterministic=False): the batch as B sequences of T, timed beside
    # the same path without it, so that the pair reads the cost of determinism alone.
    for deterministic in (False, True):
      impls["fa3 varlen" + (" deterministic" if deterministic else "")] = (
          _fa3_varlen(scale, causal, deterministic), None)
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


def _fa3_varlen(scale: float, causal: bool, deterministic: bool):
  """(q, k, v) -> FA3's attention through `flash_mha_varlen_fwd` / `_bwd` (B, T, N, H
  flattened to B · T rows of B sequences), its backward ``deterministic`` or not."""
  from flash_attn3_jax.varlen_bwd import flash_mha_varlen_bwd
  from flash_attn3_jax.varlen_fwd import flash_mha_varlen_fwd

  def sequences(q, k):
    """The B sequences' starts in the rows of q and of k (cu_seqlens), then the config."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    starts = lambda n: jnp.arange(B + 1, dtype=jnp.int32) * n
    return starts(T), starts(S), dict(max_seqlen_q=T, max_seqlen_k=S,
                                      softmax_scale=scale, is_causal=causal)

  def rows(a):
    return a.reshape(-1, *a.shape[2:])

  @jax.custom_vjp
  def attention(q, k, v):
    return forward(q, k, v)[0]

  def forward(q, k, v):
    cu_q, cu_k, config = sequences(q, k)
    out, lse = flash_mha_varlen_fwd(rows(q), rows(k), rows(v), cu_q, cu_k, **config)
    return out.reshape(*q.shape[:3], v.shape[-1]), (q, k, v, out, lse)

  def backward(residuals, do):
    q, k, v, out, lse = residuals
    cu_q, cu_k, config = sequences(q, k)
    dq, dk, dv = flash_mha_varlen_bwd(rows(do), rows(q), rows(k), rows(v), out, lse, cu_q,
                                      cu_k, **config, deterministic=deterministic)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)

  attention.defvjp(forward, backward)
  return attention


def float16_implementations(N: int, K: int, H: int, causal: bool, Hv: int):
  """The forward rows in float16, where Pallas' `attention_mgpu` (float16 only, no GQA,
  head dims a multiple of 64, one head dim for K and V) runs: it, ours, and cuDNN."""
  if K != N or H % 64 or Hv != H:
    return {}
  try:
    attention_mgpu = _pallas_ops()[1]
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128 if H <= 128 else 64,
                                         max_concurrent_steps=2, causal=causal)
    # It takes no softmax scale (its reference, attention_reference, has none): the
    # caller scales q, and the row is timed with that multiply.
    scale = H ** -0.5
    mgpu = (lambda q, k, v: attention_mgpu.attention((q * scale).astype(q.dtype), k, v,
                                                     config=config), None)
  except ImportError as e:
    mgpu = (None, f"not importable: {e}")
  impls = implementations(N, K, H, causal)
  return {"pallas attention_mgpu": mgpu, f"{OURS} mosaic_gpu": impls[f"{OURS} mosaic_gpu"],
          "cudnn": impls["cudnn"]}


def kept(rows: dict, variable: str = "ATTN_ROWS") -> dict:
  """The entries of ``rows`` (by row name) that the comma-separated environment variable
  ``variable`` names, in its order, which is the order they are timed in; all of them,
  in their own order, where it is unset. A row timed after a long one may find the GPU's
  clock lowered (harness.ClockSampler), so naming the rows in another order tells
  whether their order moved them."""
  keep = list(dict.fromkeys(filter(None, os.environ.get(variable, "").split(","))))
  if not keep:
    return dict(rows)
  return {name: rows[name] for name in keep if name in rows}


def fwd_bwd(attention):
  """q, k, v, dO -> (dq, dk, dv): the forward and the backward, as a training step runs."""
  def run(q, k, v, do):
    _, vjp = jax.vjp(attention, q, k, v)
    return vjp(do)
  return run


def dims(case):
  """(B, T, N, K, H, causal, Hv) of a case, Hv = H where the case names none."""
  B, T, N, K, H, causal, *rest = case
  return B, T, N, K, H, causal, rest[0] if rest else H


def case_inputs(case, dtype):
  """(q, k, v, dO) of a case, the report fields naming it, and its forward FLOPs
  (2·B·N·T·S·(H + Hv): QKᵀ and PV, halved when causal)."""
  B, T, N, K, H, causal, Hv = dims(case)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (B, T, N, H), dtype)
  k = jax.random.normal(keys[1], (B, T, K, H), dtype)
  v = jax.random.normal(keys[2], (B, T, K, Hv), dtype)
  do = jax.random.normal(keys[3], (B, T, N, Hv), dtype)
  shape = (B, T, N, K, H) if Hv == H else (B, T, N, K, H, Hv)
  common = dict(op="attention" + (" causal" if causal else ""), shape=shape,
                dtype=jnp.dtype(dtype).name)
  return (q, k, v, do), common, 2 * B * N * T * T * (H + Hv) / (2 if causal else 1)


def truth_slices(case):
  """(part_q, part_kv, compare_bwd, ref) of a case: the float64 truth covers batch row 0
  and the query heads of K/V head 0 (part_q of q and dO, part_kv of k and v), and
  compare_bwd takes (dq, dk, dv) to that part; ref is the reference attention."""
  causal, group = case[5], case[2] // case[3]
  part_q = lambda a: a[:1, :, :group]
  part_kv = lambda a: a[:1, :, :1]
  compare_bwd = lambda g: (part_q(g[0]), part_kv(g[1]), part_kv(g[2]))
  ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=causal)[0]
  return part_q, part_kv, compare_bwd, ref


def bench_shape(report: harness.Report, case, dtype):
  B, T, N, K, H, causal, Hv = dims(case)
  part_q, part_kv, compare_bwd, ref = truth_slices(case)

  runs = [(dtype, kept(implementations(N, K, H, causal, Hv)), report.modes)]
  if "fwd" in report.modes:
    runs.append((jnp.float16, kept(float16_implementations(N, K, H, causal, Hv)), ("fwd",)))
  for run_dtype, impls, modes in runs:
    if not impls:
      continue
    (q, k, v, do), common, flops = case_inputs(case, run_dtype)
    truth = {}
    if "fwd" in modes:
      truth["fwd"] = harness.float64_truth(ref, part_q(q), part_kv(k), part_kv(v))
    if "fwd+bwd" in modes:
      truth["fwd+bwd"] = harness.float64_truth(fwd_bwd(ref), part_q(q), part_kv(k),
                                               part_kv(v), part_q(do))
    rows = []
    for name, (attention, why) in impls.items():
      for mode in modes:
        if attention is None:
          report.skip(impl=name, mode=mode, note=why, **common)
          continue
        fn, args = (attention, (q, k, v)) if mode == "fwd" else (fwd_bwd(attention),
                                                                  (q, k, v, do))
        rows.append(dict(mode=mode, impl=name, fn=fn, arg_sets=[args],
                         flops=flops * (1 if mode == "fwd" else 3.5), truth=truth[mode],
                         compare=part_q if mode == "fwd" else compare_bwd, **common))
    # In interleaved rounds where BENCH_ROUNDS asks (harness.Report.measure_rounds).
    report.measure_rounds(rows)


# A row whose relative error exceeds this many times the smallest of its shape's rows
# computes something else (e.g. FA3's non-causal backward in
# benchmarks/results/attention_backward.md: 1e4).
_WRONG = 10


def vs_best_peer(rows) -> str:
  """Markdown: for each shape, dtype and mode, our rows' TFLOP/s over the fastest peer's
  whose errors are finite, by device time and end to end."""
  groups = {}
  for r in rows:
    if r.tflops is not None:
      groups.setdefault((r.op, r.shape, r.dtype, r.mode), []).append(r)
  lines = ["", "## Ours against the fastest peer", "",
           "Ratio of TFLOP/s (device | end to end) to the fastest peer measured in the same "
           "run whose results are right: finite errors, and a relative error at most "
           f"{_WRONG}x the smallest of the shape's rows (a peer with NaN, or with gradients "
           "off by orders of magnitude, is no bar).", "",
           "| op | shape | dtype | mode | impl | TFLOP/s | best peer | its TFLOP/s | ratio | "
           "e2e ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
  for (op, shape, dtype, mode), group in groups.items():
    errs = [r.max_rel_err for r in group
            if r.max_rel_err is not None and np.isfinite(r.max_rel_err)]
    peers = [r for r in group if not r.impl.startswith(OURS)
             and r.max_rel_err is not None and np.isfinite(r.max_rel_err)
             and r.max_rel_err <= _WRONG * min(errs)]
    if not peers:
      continue
    best = max(peers, key=lambda r: r.tflops)
    best_e2e = max(r.tflops_e2e for r in peers)
    for r in group:
      if r.impl.startswith(OURS):
        lines.append(f"| {op} | {shape} | {dtype} | {mode} | {r.impl} | {r.tflops:.0f} | "
                     f"{best.impl} | {best.tflops:.0f} | {r.tflops / best.tflops:.2f}x | "
                     f"{r.tflops_e2e / best_e2e:.2f}x |")
  return "\n".join(lines) + "\n"


def _rows(case, dtype, modes):
  # bench_shape's rows: each implementation in each mode, and float16's in the forward.
  _, _, N, K, H, causal, Hv = dims(case)
  return (len(kept(implementations(N, K, H, causal, Hv))) * len(modes)
          + len(kept(float16_implementations(N, K, H, causal, Hv))) * ("fwd" in modes))


if __name__ == "__main__":
  harness.run("attention", __doc__, SHAPES, SMOKE_SHAPES, bench_shape,
              _rows, unit="TFLOP/s", summary=vs_best_peer)
