"""What each attention feature costs: the same kernel with and without attention sinks,
ALiBi slopes, a bias (broadcast along the queries, or full per head) and a mask array,
beside cuDNN with the same bias and mask, in one run on the same inputs.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_attention_features.py --out DIR

ATTN_FEATURES=plain,sinks (a comma-separated subset of `FEATURES`) measures only those;
--modes fwd,fwd+bwd,jvp adds forward mode.

Shapes (B, T, N, K, H): 4x4096x16x16x128, full and causal, bfloat16. Rows:
  - `jaxsoftmax triton`: the Triton kernels (which read bias, masks and slopes by
    tiles), plain, with each feature;
  - `jaxsoftmax mosaic_gpu`: the Hopper kernels, plain and with sinks (joined in the
    forward kernel's epilogue, as the Triton one joins them); they run no bias, mask
    array or ALiBi, but take a key-padding mask (`api._key_mask_as_segments`, and as
    key lengths where it keeps each row's first keys, `api._key_mask_as_lengths`);
  - `cudnn`: ``jax.nn.dot_product_attention(implementation="cudnn")``, plain and with
    the same bias and mask, a key mask or key bias broadcast along the queries (the only
    form it takes); it takes no sinks or ALiBi slopes.
Features: `sinks` (N,) logits; `alibi` slopes 2^-(n+1); `bias keys` (B, 1, 1, S) (a
key-padding bias); `bias heads` (1, N, T, S) (a relative-position bias); `mask`
(B, 1, T, S) booleans, 10% False, with every key past 3/4 of S masked for batch row 1
(whole tiles the kernels skip); `mask keys` (B, 1, 1, S), a key-padding mask: batch row
b attends to its first S · (1 - b/8) keys (so it runs as key lengths); `mask keys holes`
the same with every 61st key masked too (so it runs as segment ids or a mask array);
`key lengths` the same keys as `mask keys` given as ``key_value_seq_lengths`` (cuDNN's
form of a padded batch; ours without the mask's check); `bias heads grad` a learnable
relative-position bias: (1, N, T, S) float32, as Flax keeps parameters, differentiated
too (fwd+bwd only: dbias, which the Triton dQ kernel adds into one array of the bias's
shape); `segments packed` ``segment_ids`` (B, T) of eight documents of T/8 tokens
in each batch row (packed sequences: the Triton walks skip the key blocks of other
documents, `tiling.live_block_spans`; the Hopper kernels compare the ids on every
block; cuDNN takes no segment ids through ``jax.nn``). The
mode fwd+bwd differentiates q, k and v
(the bias and mask held fixed, as a model's frozen bias would be); jvp is forward mode,
``jax.jvp`` with tangents for q, k and v (our forward, then the Triton tangent kernel),
beside ``jax.nn.dot_product_attention(implementation="xla")``'s (`xla`, jvp rows only;
cuDNN's has no forward mode, its rows say so).

Errors against the float64 truth of the same feature on batch row 0 and the query heads
of K/V head 0 (`bench_attention.truth_slices`). FLOPs: the plain call's, 4·B·N·T·S·H
(halved when causal; 3.5x for forward + backward and for forward mode, whose tangent
pass recomputes S and forms Q̇Kᵀ, QK̇ᵀ, (P∘Ṡ)V and PV̇), so a feature's TFLOP/s against
the plain row's is its cost. The table ends with each feature's time over its kernel's
plain row (`feature_costs`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

import harness
import jaxsoftmax as js
from bench_attention import case_inputs, fwd_bwd
from jaxsoftmax.attention import reference

SHAPES = [((4, 4096, 16, 16, 128, False), jnp.bfloat16),
          ((4, 4096, 16, 16, 128, True), jnp.bfloat16)]
SMOKE_SHAPES = [((2, 64, 2, 1, 32, True), jnp.bfloat16)]
FEATURES = ("plain", "sinks", "alibi", "bias keys", "bias heads", "mask", "mask keys",
            "mask keys holes", "key lengths", "bias heads grad", "segments packed")
# Features whose bias is an argument of the step and differentiated, in fwd+bwd only.
GRAD_BIAS = ("bias heads grad",)


def measured_features() -> tuple[str, ...]:
  """`FEATURES`, or the subset that ATTN_FEATURES names."""
  names = os.environ.get("ATTN_FEATURES")
  if not names:
    return FEATURES
  chosen = tuple(name.strip() for name in names.split(","))
  unknown = set(chosen) - set(FEATURES)
  if unknown:
    raise SystemExit(f"ATTN_FEATURES: unknown {sorted(unknown)}; the features are {FEATURES}")
  return chosen

# Which features each implementation runs.
RUNS = {"jaxsoftmax triton": FEATURES,
        "jaxsoftmax mosaic_gpu": ("plain", "sinks", "mask keys", "mask keys holes",
                                  "key lengths", "segments packed"),
        "cudnn": ("plain", "bias keys", "bias heads", "mask", "mask keys", "mask keys holes",
                  "key lengths", "bias heads grad"),
        "xla": FEATURES}
# The modes an implementation runs where not all (XLA's attention: forward mode's peer).
MODES_OF = {"xla": ("jvp",)}


def feature_arrays(feature: str, B: int, T: int, N: int):
  """The keyword arguments of ``feature`` for the whole problem, and a function that
  takes them to the truth's part (batch row 0, the query heads of K/V head 0, `group`
  of them)."""
  key = jax.random.PRNGKey(1)
  if feature == "plain":
    return {}, lambda kw, group: {}
  if feature == "sinks":
    return ({"sinks": jnp.linspace(-2.0, 2.0, N)},
            lambda kw, group: {"sinks": kw["sinks"][:group]})
  if feature == "alibi":
    slopes = 2.0 ** -jnp.arange(1, N + 1, dtype=jnp.float32)
    return ({"alibi_slopes": slopes},
            lambda kw, group: {"alibi_slopes": kw["alibi_slopes"][:group]})
  if feature == "bias keys":
    return ({"bias": jax.random.normal(key, (B, 1, 1, T), jnp.float32)},
            lambda kw, group: {"bias": kw["bias"][:1]})
  if feature in ("bias heads", "bias heads grad"):
    dtype = jnp.float32 if feature in GRAD_BIAS else jnp.bfloat16
    return ({"bias": jax.random.normal(key, (1, N, T, T), dtype)},
            lambda kw, group: {"bias": kw["bias"][:, :group]})
  if feature == "segments packed":
    segments = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) // (T // 8), (B, T))
    return ({"segment_ids": segments},
            lambda kw, group: {"q_segments": kw["segment_ids"][:1],
                               "kv_segments": kw["segment_ids"][:1]})
  lengths = T - T * jnp.arange(B) // 8
  if feature == "key lengths":
    return ({"key_value_seq_lengths": lengths},
            lambda kw, group: {"key_value_seq_lengths": kw["key_value_seq_lengths"][:1]})
  if feature in ("mask keys", "mask keys holes"):
    mask = (jnp.arange(T)[None, :] < lengths[:, None])[:, None, None, :]
    if feature == "mask keys holes":
      mask = mask & (jnp.arange(T) % 61 != 60)[None, None, None, :]
    return {"mask": mask}, lambda kw, group: {"mask": kw["mask"][:1]}
  assert feature == "mask", feature
  mask = jax.random.bernoulli(key, 0.9, (B, 1, T, T))
  mask = mask.at[1, :, :, 3 * T // 4:].set(False)
  return {"mask": mask}, lambda kw, group: {"mask": kw["mask"][:1]}


def attention_fn(impl: str, causal: bool, kw: dict):
  if impl == "cudnn":
    def cudnn(q, k, v):
      # jax.nn's cuDNN path takes a bias or mask only with its query axis whole (a key
      # mask (B, 1, 1, S) raises "Bias must have same seq length as QKV"), so a key
      # mask or key bias is broadcast along the queries, as its users must.
      T, S = q.shape[1], k.shape[1]
      bias, mask = ((x if x is None else jnp.broadcast_to(x, (x.shape[0], x.shape[1], T, S)))
                    for x in (kw.get("bias"), kw.get("mask")))
      return jax.nn.dot_product_attention(
          q, k, v, bias, mask, is_causal=causal, implementation="cudnn",
          key_value_seq_lengths=kw.get("key_value_seq_lengths"))
    return cudnn
  if impl == "xla":  # with every feature, as the reference spells them
    if "segment_ids" in kw:
      segments = kw["segment_ids"]
      kw = {**{name: x for name, x in kw.items() if name != "segment_ids"},
            "q_segments": segments, "kv_segments": segments}
    return lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=causal,
                                                           **kw)[0]
  backend = impl.split()[-1]
  return lambda q, k, v: js.dot_product_attention(q, k, v, is_causal=causal,
                                                  implementation=backend, **kw)


def bench_shape(report: harness.Report, case, dtype):
  B, T, N, K, H, causal = case
  group = N // K
  (q, k, v, do), common, flops = case_inputs(case, dtype)
  part_q = lambda a: a[:1, :, :group]
  part_kv = lambda a: a[:1, :, :1]
  compare_bwd = lambda g: (part_q(g[0]), part_kv(g[1]), part_kv(g[2]))
  for feature in measured_features():
    kw, part = feature_arrays(feature, B, T, N)
    kw_part = part(kw, group)
    if feature in GRAD_BIAS:
      _bench_bias_grad(report, feature, causal, kw, kw_part, (q, k, v, do), common, flops)
      continue
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=causal,
                                                          **kw_part)[0]
    parts = (part_q(q), part_kv(k), part_kv(v), part_q(do))
    truth = {mode: harness.float64_truth(_mode_fn(mode, ref), *parts[:3 + (mode != "fwd")])
             for mode in report.modes}
    for impl, runs in RUNS.items():
      if feature not in runs:
        continue
      attention = attention_fn(impl, causal, kw)
      for mode in report.modes:
        if mode not in MODES_OF.get(impl, report.modes):
          continue
        args = (q, k, v) if mode == "fwd" else (q, k, v, do)
        report.measure(mode=mode, impl=f"{impl} {feature}", fn=_mode_fn(mode, attention),
                       arg_sets=[args], flops=flops * (1 if mode == "fwd" else 3.5),
                       truth=truth[mode], compare=compare_bwd if mode == "fwd+bwd" else part_q,
                       **common)


def _bench_bias_grad(report, feature, causal, kw, kw_part, inputs, common, flops):
  """fwd+bwd rows of a feature whose bias is differentiated: q, k, v, dO and the bias
  are the step's arguments, (dq, dk, dv, dbias) its result. The errors cover the query
  heads of K/V head 0 in every batch row, since dbias sums over the batch."""
  if "fwd+bwd" not in report.modes:
    return
  q, k, v, do = inputs
  bias, bias_part = kw["bias"], kw_part["bias"]
  group = bias_part.shape[1]
  part_q = lambda a: a[:, :, :group]
  part_kv = lambda a: a[:, :, :1]

  def step(attention):
    def run(q, k, v, do, bias):
      _, vjp = jax.vjp(lambda q, k, v, bias: attention(q, k, v, bias), q, k, v, bias)
      return vjp(do)
    return run

  ref = lambda q, k, v, bias: reference.dot_product_attention(q, k, v, bias=bias,
                                                              is_causal=causal)[0]
  truth = harness.float64_truth(step(ref), part_q(q), part_kv(k), part_kv(v), part_q(do),
                                bias_part)
  compare = lambda g: (part_q(g[0]), part_kv(g[1]), part_kv(g[2]), g[3][:, :group])
  for impl, runs in RUNS.items():
    if feature not in runs or "fwd+bwd" not in MODES_OF.get(impl, report.modes):
      continue
    attention = lambda q, k, v, bias, impl=impl: attention_fn(impl, causal, {"bias": bias})(
        q, k, v)
    report.measure(mode="fwd+bwd", impl=f"{impl} {feature}", fn=step(attention),
                   arg_sets=[(q, k, v, do, bias)], flops=flops * 3.5, truth=truth,
                   compare=compare, **common)


def _mode_fn(mode: str, attention):
  """What ``mode`` times of ``attention``: the forward (q, k, v -> o), a training step's
  forward and backward (q, k, v, dO -> dq, dk, dv), or forward mode (q, k, v, t -> the
  output's tangent for the tangents (t, k, v) of (q, k, v), reusing the inputs as
  tangents)."""
  if mode == "fwd":
    return attention
  if mode == "fwd+bwd":
    return fwd_bwd(attention)
  assert mode == "jvp", mode
  return lambda q, k, v, t: jax.jvp(attention, (q, k, v), (t, k, v))[1]


def feature_costs(rows) -> str:
  """Markdown: each feature's device time over the plain row of the same implementation,
  shape and mode."""
  plain = {(r.op, r.shape, r.mode, r.impl.rsplit(" ", 1)[0]): r.median_us for r in rows
           if r.impl.endswith(" plain") and r.median_us is not None}
  lines = ["", "## Cost of each feature", "",
           "Device time with the feature over the same implementation's plain call.", "",
           "| op | shape | mode | impl | feature | time / plain |", "|---|---|---|---|---|---|"]
  for r in rows:
    if r.median_us is None or r.impl.endswith(" plain"):
      continue
    for feature in FEATURES:
      if r.impl.endswith(" " + feature):
        impl = r.impl[:-len(feature) - 1]
        base = plain.get((r.op, r.shape, r.mode, impl))
        if base:
          lines.append(f"| {r.op} | {r.shape} | {r.mode} | {impl} | {feature} | "
                       f"{r.median_us / base:.3f}x |")
  return "\n".join(lines) + "\n"


def _rows(case, dtype, modes):
  features = measured_features()
  count = 0
  for impl, runs in RUNS.items():
    impl_modes = set(MODES_OF.get(impl, modes)) & set(modes)
    for feature in set(runs) & set(features):
      count += len(impl_modes & {"fwd+bwd"}) if feature in GRAD_BIAS else len(impl_modes)
  return count


if __name__ == "__main__":
  harness.run("attention_features", __doc__, SHAPES, SMOKE_SHAPES, bench_shape, _rows,
              unit="TFLOP/s", summary=feature_costs)
