"""Causal self-attention on a sequence sharded along its length over every device
(context parallelism), against the same attention on one device.

    python examples/long_context.py                  # a CPU: 8 virtual devices, tiny sizes
    python examples/long_context.py --tokens 65536   # GPUs: all visible ones

The tokens are put in zigzag order once (`jaxsoftmax.zigzag_permute`: under a causal
mask every device then does the same work), placed with the sequence axis sharded, and a
jitted step runs `jaxsoftmax.ring_attention` inside `jax.shard_map`: forward, and the
gradients of a loss through its custom VJP. Printed: the largest differences of the
output and gradients from single-device attention (`jaxsoftmax.dot_product_attention`),
and the median step times of both.
"""

from __future__ import annotations

import os

# Eight virtual devices where the host is the only platform (ignored by GPUs); set before
# JAX starts.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import jaxsoftmax as js  # noqa: E402
from jaxsoftmax.attention.context_parallel.ring import STRATEGIES  # noqa: E402


def median_time(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main():
  on_gpu = jax.default_backend() == "gpu"
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=32768 if on_gpu else 256)
  parser.add_argument("--heads", type=int, default=16 if on_gpu else 4)
  parser.add_argument("--kv-heads", type=int, default=16 if on_gpu else 2)
  parser.add_argument("--head-dim", type=int, default=128 if on_gpu else 32)
  parser.add_argument("--strategy", choices=STRATEGIES, default="ring")
  parser.add_argument("--repeats", type=int, default=5 if on_gpu else 2)
  args = parser.parse_args()

  devices = jax.devices()
  shards = len(devices)
  mesh = jax.make_mesh((shards,), ("sp",), devices=devices)
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  T, N, K, H = args.tokens, args.heads, args.kv_heads, args.head_dim
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, w = (jax.random.normal(k, (1, T, N, H), jnp.float32).astype(dtype) for k in keys[:2])
  k, v = (jax.random.normal(k, (1, T, K, H), jnp.float32).astype(dtype) for k in keys[2:])
  print(f"{shards} x {devices[0].device_kind}; B=1 T={T} N={N} K={K} H={H} {dtype.__name__}, "
        f"causal, {args.strategy}, zigzag")

  # Context parallel: tokens zigzag-ordered once, sequence axis sharded over "sp".
  tokens = PartitionSpec(None, "sp")
  place = lambda x: jax.device_put(js.zigzag_permute(x, shards), NamedSharding(mesh, tokens))
  attention = jax.shard_map(
      functools.partial(js.ring_attention, axis_name="sp", is_causal=True, layout="zigzag",
                        strategy=args.strategy),
      mesh=mesh, in_specs=(tokens,) * 3, out_specs=tokens, check_vma=False)

  def loss(attention, q, k, v, w):  # a scalar that depends on every output element
    return jnp.sum(attention(q, k, v).astype(jnp.float32) * w.astype(jnp.float32))

  sharded_step = jax.jit(jax.value_and_grad(functools.partial(loss, attention),
                                            argnums=(0, 1, 2)))
  single = functools.partial(js.dot_product_attention, is_causal=True)
  single_step = jax.jit(jax.value_and_grad(functools.partial(loss, single),
                                           argnums=(0, 1, 2)))

  zq, zk, zv, zw = (place(x) for x in (q, k, v, w))
  out = jax.jit(attention)(zq, zk, zv)
  expected = single(q, k, v)
  (_, grads) = sharded_step(zq, zk, zv, zw)
  (_, expected_grads) = single_step(q, k, v, w)
  unpermute = lambda x: js.zigzag_unpermute(np.asarray(x, np.float32), shards)
  for name, a, b in zip(("output", "dq", "dk", "dv"), (out, *grads),
                        (expected, *expected_grads)):
    diff = np.max(np.abs(unpermute(a) - np.asarray(b, np.float32)))
    print(f"  {name}: largest difference from one device {diff:.2e}")

  t_sharded = median_time(sharded_step, zq, zk, zv, zw, repeats=args.repeats)
  t_single = median_time(single_step, q, k, v, w, repeats=args.repeats)
  print(f"  forward + backward: {t_sharded * 1e3:.2f} ms on {shards} devices, "
        f"{t_single * 1e3:.2f} ms on one ({t_single / t_sharded:.2f}x)")


if __name__ == "__main__":
  main()
