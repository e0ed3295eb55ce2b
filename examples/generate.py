"""Greedy generation with a KV cache: the transformer of examples/train_transformer.py
decodes token by token on jaxsoftmax's `decode_attention` (a contiguous cache and a paged
one) beside the same model on jax.nn.dot_product_attention (XLA).

    python examples/generate.py                      # CPU: a tiny model, XLA path
    JAXSOFTMAX_INTERPRET=1 python examples/generate.py --new-tokens 6   # the kernels, interpreted

Each step is one jitted call per token: the newest token's keys and values are written
into every layer's cache (`update_kv_cache`; under jit with the caches donated, in
place), its query attends to the cache (`lengths` counts the valid positions), and the
next token is the argmax of the logits. The prompt is fed through the same step. jax.nn
generates first, and the jaxsoftmax decoders then run teacher-forced on its tokens; the
script checks that their logits agree with its at every step to the attention dtype's
rounding (and, in float32, that they pick the same tokens), and exits non-zero when they
disagree. On a GPU: a
batch of 64 sequences, bfloat16 attention, and the tokens per second of each (off a GPU
the times would mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_transformer import init_params, rms_norm, where_it_runs  # noqa: E402

import jaxsoftmax as js  # noqa: E402


def make_step(attend, write, *, heads, kv_heads, head_dim, attn_dtype):
  """step(params, caches, tokens (B,), lengths (B,)) -> (logits (B, V), caches): the
  model on the newest token of each sequence, at position lengths - 1."""

  def step(params, caches, tokens, lengths):
    B = tokens.shape[0]
    x = params["embed"][tokens] + params["position"][lengths - 1]
    x = x[:, None]  # (B, 1, D)
    new_caches = []
    for p, (k_cache, v_cache) in zip(params["blocks"], caches):
      qkv = rms_norm(x, p["norm1"]) @ p["qkv"]
      q, k, v = jnp.split(qkv, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1)
      q = q.reshape(B, 1, heads, head_dim).astype(attn_dtype)
      k_cache = write(k_cache, k.reshape(B, 1, kv_heads, head_dim), lengths)
      v_cache = write(v_cache, v.reshape(B, 1, kv_heads, head_dim), lengths)
      o = attend(q, k_cache, v_cache, lengths).astype(jnp.float32)
      x = x + o.reshape(B, 1, heads * head_dim) @ p["out"]
      x = x + jax.nn.gelu(rms_norm(x, p["norm2"]) @ p["up"]) @ p["down"]
      new_caches.append((k_cache, v_cache))
    logits = rms_norm(x[:, 0], params["norm"]) @ params["embed"].T
    return logits, new_caches

  return step


def xla_write(cache, new, lengths):
  """The reference model's own cache update: each sequence's row at lengths - 1."""
  return jax.vmap(lambda c, n, at: jax.lax.dynamic_update_slice_in_dim(c, n, at, axis=0))(
      cache, new.astype(cache.dtype), lengths - 1)


def generate(step, params, caches, prompt, new_tokens: int, forced=None):
  """Greedy tokens (B, new_tokens), the logits of each step, and the wall time of the
  generated steps (after the first, which compiles). ``forced`` (B, new_tokens): feed
  these tokens instead of the model's own picks (teacher forcing), so that two decoders
  see the same inputs at every step; the returned tokens are still the model's picks."""
  B, P = prompt.shape
  tokens, logits_all, times = [], [], []
  token = prompt[:, 0]
  for i in range(P + new_tokens - 1):
    lengths = jnp.full((B,), i + 1, jnp.int32)
    start = time.perf_counter()
    logits, caches = step(params, caches, token, lengths)
    logits = jax.block_until_ready(logits)
    if i >= P:
      times.append(time.perf_counter() - start)
    if i + 1 < P:
      token = prompt[:, i + 1]
    else:
      token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      tokens.append(token)
      logits_all.append(logits)
      if forced is not None:
        token = forced[:, len(tokens) - 1]
  return jnp.stack(tokens, axis=1), jnp.stack(logits_all, axis=1), times


def main():
  on_gpu = jax.default_backend() == "gpu"
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=64 if on_gpu else 2)
  parser.add_argument("--prompt", type=int, default=16 if on_gpu else 4)
  parser.add_argument("--new-tokens", type=int, default=64 if on_gpu else 12)
  parser.add_argument("--dim", type=int, default=1024 if on_gpu else 64)
  parser.add_argument("--layers", type=int, default=4 if on_gpu else 2)
  parser.add_argument("--heads", type=int, default=8 if on_gpu else 4)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--head-dim", type=int, default=128 if on_gpu else 16)
  parser.add_argument("--vocab", type=int, default=32000 if on_gpu else 64)
  parser.add_argument("--page-size", type=int, default=64 if on_gpu else 4)
  args = parser.parse_args()
  attn_dtype = jnp.bfloat16 if on_gpu else jnp.float32
  S = args.prompt + args.new_tokens  # cache positions per sequence
  print(f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; {where_it_runs(on_gpu)}; "
        f"{args.layers} layers, dim {args.dim}, {args.heads} heads on {args.kv_heads} K/V "
        f"heads of {args.head_dim}; batch {args.batch}, prompt {args.prompt}, "
        f"{args.new_tokens} new tokens; attention in {jnp.dtype(attn_dtype).name}")

  key_params, key_prompt, key_pages = jax.random.split(jax.random.PRNGKey(0), 3)
  params = init_params(key_params, vocab=args.vocab, dim=args.dim, heads=args.heads,
                       kv_heads=args.kv_heads, head_dim=args.head_dim, layers=args.layers,
                       seq=S)
  prompt = jax.random.randint(key_prompt, (args.batch, args.prompt), 1, args.vocab)
  shape = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
               attn_dtype=attn_dtype)
  # Two buffers per layer (keys, values), never one twice: the step donates them all.
  zeros = lambda shape: tuple(jnp.zeros(shape, attn_dtype) for _ in range(2))
  contiguous = lambda: [zeros((args.batch, S, args.kv_heads, args.head_dim))
                        for _ in range(args.layers)]
  # A paged cache: each sequence's pages scattered over a shared pool.
  per_seq = -(-S // args.page_size)
  pool = args.batch * per_seq + 1
  table = jax.random.permutation(key_pages, pool)[:args.batch * per_seq].reshape(
      args.batch, per_seq).astype(jnp.int32)
  paged = lambda: [zeros((pool, args.page_size, args.kv_heads, args.head_dim))
                   for _ in range(args.layers)]
  decoders = {
      "jaxsoftmax contiguous": (js.decode_attention, js.update_kv_cache, contiguous),
      "jaxsoftmax paged": (functools.partial(js.decode_attention, block_table=table),
                           functools.partial(js.update_kv_cache, block_table=table), paged),
      "jax.nn": (lambda q, k, v, lengths: jax.nn.dot_product_attention(
          q, k, v, key_value_seq_lengths=lengths), xla_write, contiguous),
  }
  # jax.nn generates first; the others then decode teacher-forced on its tokens, so each
  # step's logits compare on the same inputs. Left free, one token picked differently
  # at a near tie (bfloat16 attention rounds differently in each kernel) would send the
  # sequences apart and every later logit with them.
  results = {}
  for name in ("jax.nn", "jaxsoftmax contiguous", "jaxsoftmax paged"):
    attend, write, caches = decoders[name]
    step = jax.jit(make_step(attend, write, **shape), donate_argnums=(1,) if on_gpu else ())
    forced = None if name == "jax.nn" else results["jax.nn"][0]
    tokens, logits, times = generate(step, params, caches(), prompt, args.new_tokens, forced)
    results[name] = (tokens, logits)
    if on_gpu:  # off a GPU the times are XLA's (or the interpreter's), not the kernels'
      rate = args.batch * len(times) / sum(times) if times else float("nan")
      ms = 1e3 * sum(times) / len(times) if times else float("nan")
      print(f"{name:22s} {rate:10.1f} tokens/s, {ms:6.2f} ms a step (wall, {len(times)} "
            f"steps after the first)")

  tokens_ref, logits_ref = results["jax.nn"]
  tolerance = 5e-2 if attn_dtype == jnp.bfloat16 else 1e-4
  scale = float(jnp.max(jnp.abs(logits_ref)))
  # The check is the logits, step by step on the same inputs. The picks follow from them:
  # in float32 they must all agree; in bfloat16 a pick may differ only at a near tie,
  # where jax.nn's best logit leads its second by less than twice the logits' gap there.
  top2 = jax.lax.top_k(logits_ref, 2)[0]
  margin = top2[..., 0] - top2[..., 1]
  ok = True
  for name in ("jaxsoftmax contiguous", "jaxsoftmax paged"):
    tokens, logits = results[name]
    same = tokens == tokens_ref
    step_gap = jnp.max(jnp.abs(logits - logits_ref), axis=-1)
    gap = float(jnp.max(step_gap)) / scale
    ties = int(jnp.sum(margin <= 2 * step_gap))
    print(f"{name}: logits within {gap:.2e} of jax.nn's (relative); "
          f"{100 * float(jnp.mean(same)):.1f}% of the picks as its ({int(jnp.sum(~same))} "
          f"differ; {ties} of {same.size} steps were near ties)")
    ok = ok and gap <= tolerance and (attn_dtype == jnp.bfloat16 or bool(jnp.all(same)))
  print("first sequence:", " ".join(str(int(t)) for t in tokens_ref[0]))
  if not ok:
    sys.exit(f"FAILED: the decoders disagree (tolerance {tolerance:.0e})")
  print("OK: decode_attention, contiguous and paged, generates what jax.nn does")


if __name__ == "__main__":
  main()
