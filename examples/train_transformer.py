"""Train a small transformer language model with jaxsoftmax's attention and fused output
layer + cross-entropy (`linear_cross_entropy`), beside the same model on
jax.nn.dot_product_attention, a matmul and optax's cross-entropy.

    examples/run                                   # sets up .venv, then runs this script
    python examples/train_transformer.py --steps 20 --trace /tmp/trace

A decoder-only model (pre-norm blocks: causal multi-head attention with GQA, then a GELU
MLP; tied embeddings) learns a synthetic copy task. Each step is one jitted update
(forward, `jax.grad` through our custom derivatives, an Adam update). The same step of the
jax.nn + optax model (XLA's autodiff) runs on the same parameters and batch as the check:
printed per step are both losses and the largest gradient difference, relative to the
gradient's scale; the script exits non-zero when they disagree by more than the attention
dtype's rounding explains. Both steps are timed.
With ``--trace DIR`` one more step of our model runs under `jax.profiler.trace`, and the
kernels in that trace are listed with their device times (open DIR in TensorBoard or
Perfetto for the timeline).

On a GPU the default is a real size with bfloat16 attention and output layer, on the
compiled kernels; on a CPU a tiny model in float32 on the ops' XLA path (the kernels
interpreted with JAXSOFTMAX_INTERPRET=1), which learns the copy task in 150 steps.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import jaxsoftmax as js


def init_params(key, *, vocab, dim, heads, kv_heads, head_dim, layers, seq):
  def dense(key, fan_in, shape):
    return jax.random.normal(key, shape, jnp.float32) / fan_in ** 0.5

  keys = iter(jax.random.split(key, 2 + 4 * layers))
  # Learned positions: the copy task needs to know how far back its token is.
  params = {"embed": dense(next(keys), 1, (vocab, dim)) * 0.02,
            "position": dense(next(keys), 1, (seq, dim)) * 0.02, "blocks": []}
  for _ in range(layers):
    params["blocks"].append({
        "norm1": jnp.ones(dim), "norm2": jnp.ones(dim),
        "qkv": dense(next(keys), dim, (dim, (heads + 2 * kv_heads) * head_dim)),
        "out": dense(next(keys), heads * head_dim, (heads * head_dim, dim)),
        "up": dense(next(keys), dim, (dim, 4 * dim)),
        "down": dense(next(keys), 4 * dim, (4 * dim, dim)),
    })
  params["norm"] = jnp.ones(dim)
  return params


def rms_norm(x, weight):
  return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
          * weight.reshape((1,) * (x.ndim - 1) + weight.shape))


def make_model(attention, head_loss, *, heads, kv_heads, head_dim, attn_dtype):
  """loss(params, tokens): next-token cross-entropy of the model built on ``attention``
  (q, k, v -> causal attention) and ``head_loss`` (hidden (R, D), the tied output weight
  (D, V), labels (R,) -> mean loss; both in ``attn_dtype``)."""

  def block(x, p):
    B, T, _ = x.shape
    qkv = rms_norm(x, p["norm1"]) @ p["qkv"]
    q, k, v = jnp.split(qkv, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1)
    q = q.reshape(B, T, heads, head_dim).astype(attn_dtype)
    k = k.reshape(B, T, kv_heads, head_dim).astype(attn_dtype)
    v = v.reshape(B, T, kv_heads, head_dim).astype(attn_dtype)
    o = attention(q, k, v).astype(jnp.float32).reshape(B, T, heads * head_dim)
    x = x + o @ p["out"]
    return x + jax.nn.gelu(rms_norm(x, p["norm2"]) @ p["up"]) @ p["down"]

  def loss(params, tokens):
    x = params["embed"][tokens[:, :-1]] + params["position"][None, :tokens.shape[1] - 1]
    for p in params["blocks"]:
      x = block(x, p)
    hidden = rms_norm(x, params["norm"]).astype(attn_dtype)
    return head_loss(hidden.reshape(-1, hidden.shape[-1]),
                     params["embed"].T.astype(attn_dtype), tokens[:, 1:].reshape(-1))

  return loss


def copy_task(key, *, batch, seq, vocab):
  """Batches of a random prefix followed by its copy: the second half is predictable."""
  def batch_at(step):
    half = jax.random.randint(jax.random.fold_in(key, step), (batch, (seq + 1) // 2), 1,
                              vocab)
    return jnp.concatenate([half, half], axis=1)[:, :seq + 1]
  return batch_at


def relative_gap(grads, grads_ref) -> float:
  """max |g - g_ref| / max |g_ref| over the parameter arrays."""
  return max(float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))
             for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)))


def kernel_times(trace_dir: str):
  """(name, count, total device us) of the GPU kernels in a jax.profiler trace."""
  from jax.profiler import ProfileData
  totals = collections.defaultdict(lambda: [0, 0.0])
  for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
    for plane in ProfileData.from_file(path).planes:
      if not plane.name.startswith("/device:GPU"):
        continue
      for line in plane.lines:
        if line.name.startswith("Stream"):
          for event in line.events:
            totals[event.name][0] += 1
            totals[event.name][1] += event.duration_ns / 1e3
  return sorted(((n, c, t) for n, (c, t) in totals.items()), key=lambda r: -r[2])


def where_it_runs(on_gpu: bool) -> str:
  """What runs the ops here, for the examples' first line."""
  if on_gpu:
    return "compiled Pallas kernels"
  if os.environ.get("JAXSOFTMAX_INTERPRET") == "1":
    return "the Pallas kernels, interpreted"
  return "the ops' XLA path (no GPU; JAXSOFTMAX_INTERPRET=1 interprets the kernels)"


def main():
  on_gpu = jax.default_backend() == "gpu"
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20 if on_gpu else 150)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=2048 if on_gpu else 40)
  parser.add_argument("--dim", type=int, default=1024 if on_gpu else 64)
  parser.add_argument("--lr", type=float, default=5e-4 if on_gpu else 3e-3)
  parser.add_argument("--layers", type=int, default=4 if on_gpu else 2)
  parser.add_argument("--heads", type=int, default=8 if on_gpu else 4)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--head-dim", type=int, default=128 if on_gpu else 16)
  parser.add_argument("--vocab", type=int, default=32000 if on_gpu else 64)
  parser.add_argument("--trace", default=None, help="write a jax.profiler trace of a step")
  args = parser.parse_args()
  attn_dtype = jnp.bfloat16 if on_gpu else jnp.float32
  print(f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; {where_it_runs(on_gpu)}; "
        f"{args.layers} layers, "
        f"dim {args.dim}, {args.heads} heads on {args.kv_heads} K/V heads of "
        f"{args.head_dim}, batch {args.batch} x {args.seq} tokens, vocab {args.vocab}, "
        f"attention in {jnp.dtype(attn_dtype).name}")
  q = jnp.zeros((args.batch, args.seq, args.heads, args.head_dim), attn_dtype)
  kv = jnp.zeros((args.batch, args.seq, args.kv_heads, args.head_dim), attn_dtype)
  forward, backward = js.attention_kernels(q, kv, kv, is_causal=True)
  print(f"attention kernels: {forward} forward, {backward} backward")

  shape = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
               attn_dtype=attn_dtype)
  models = {
      # The output layer and the loss fused: the (tokens x vocab) logits are never written.
      "jaxsoftmax": make_model(
          lambda q, k, v: js.dot_product_attention(q, k, v, is_causal=True),
          js.linear_cross_entropy, **shape),
      "jax.nn+optax": make_model(
          lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
          lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(
              jnp.dot(h, w, preferred_element_type=jnp.float32), y).mean(), **shape),
  }
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.lr))

  def make_step(loss):
    @jax.jit
    def step(params, opt_state, tokens):
      value, grads = jax.value_and_grad(loss)(params, tokens)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value, grads
    return step

  key_data, key_init = jax.random.split(jax.random.PRNGKey(0))
  batch_at = copy_task(key_data, batch=args.batch, seq=args.seq, vocab=args.vocab)
  params0 = init_params(key_init, vocab=args.vocab, dim=args.dim, heads=args.heads,
                        kv_heads=args.kv_heads, head_dim=args.head_dim, layers=args.layers,
                        seq=args.seq)
  state = (params0, optimizer.init(params0))
  steps = {name: make_step(loss) for name, loss in models.items()}
  times = {name: [] for name in models}
  # Both models compute the same function; what separates them is rounding: float32
  # accumulation order, and bfloat16 attention inputs and outputs on a GPU.
  tolerance = 5e-2 if attn_dtype == jnp.bfloat16 else 1e-4
  worst_loss, worst_grad = 0.0, 0.0

  print(f"{'step':>5} {'loss (ours)':>12} {'loss (jax.nn)':>14} {'grad gap (rel)':>15}")
  for step in range(args.steps):
    tokens = batch_at(step)
    results = {}
    for name in models:  # both on the same parameters; ours is the one that trains on
      start = time.perf_counter()
      results[name] = jax.block_until_ready(steps[name](*state, tokens))
      times[name].append(time.perf_counter() - start)
    state = results["jaxsoftmax"][:2]
    (loss, grads), (loss_ref, grads_ref) = (results[name][2:] for name in models)
    if step == 0:
      first_loss = float(loss)
    gap = relative_gap(grads, grads_ref)
    worst_loss = max(worst_loss, abs(float(loss) - float(loss_ref)) / abs(float(loss_ref)))
    worst_grad = max(worst_grad, gap)
    if step % max(1, args.steps // 15) == 0 or step == args.steps - 1:
      print(f"{step:5d} {float(loss):12.5f} {float(loss_ref):14.5f} {gap:15.2e}")

  # The copy task's floor: the first half of each sequence is random, ln(vocab) a token.
  print(f"\nthe loss fell from {first_loss:.3f} to {float(loss):.3f} (the task's floor is "
        f"about {jnp.log(args.vocab) * ((args.seq + 1) // 2) / args.seq:.2f})")
  if on_gpu:  # off a GPU the times are XLA's, not the kernels'
    median_ms = {name: 1e3 * statistics.median(t[1:] or t) for name, t in times.items()}
    print("median step (wall, after the compiling first one): "
          + ", ".join(f"{name} {ms:.1f} ms" for name, ms in median_ms.items()))
  print(f"largest relative loss gap {worst_loss:.2e}, gradient gap {worst_grad:.2e} "
        f"(tolerance {tolerance:.0e})")

  if args.trace:
    with jax.profiler.trace(args.trace):
      jax.block_until_ready(steps["jaxsoftmax"](*state, batch_at(args.steps)))
    print(f"profiler trace of one step in {args.trace}")
    rows = kernel_times(args.trace)
    if rows:
      print(f"{'device us':>10} {'calls':>6}  kernel (top 12 of {len(rows)})")
      for name, count, total in rows[:12]:
        print(f"{total:10.1f} {count:6d}  {name[:90]}")
    else:
      print("(no device kernels in the trace: the kernels ran interpreted on the host)")

  if worst_loss > tolerance or worst_grad > tolerance:
    sys.exit(f"FAILED: the models disagree beyond {tolerance:.0e}")
  print("OK: our attention and output layer + cross-entropy match jax.nn and optax")


if __name__ == "__main__":
  main()
