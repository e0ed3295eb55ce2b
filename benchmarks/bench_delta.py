"""The attention backward's preprocessing alone: delta = rowsum(dO ∘ O) as (B, N, T)
float32 and the zeroed float32 dQ the Hopper backward adds into, in ways XLA or a Pallas
kernel could compute them, timed on the device beside the bandwidth they need.

Why: on an H100 at 4x4096x16x128 causal the delta fusion took 67.8 us and zeroing dQ
41.8 us, against FlashAttention-3's one preprocess kernel's 87.7 us for both
(`benchmarks/results/tuning/kernels_ncu_4x4096_causal_h100.md`); delta reads 134 MB,
which is 40 us at 3.35 TB/s.

    python3 benchmarks/bench_delta.py [--shape B,T,N,H ...] [--o-dtype float32]

Rows: "einsum bnt" (`logits.row_delta` as the backward calls it), "sum btn then
transpose", "pallas delta" (a Triton Pallas kernel writing delta alone; T a multiple of
its 64 rows), the zeros alone, "einsum + zeros" and "pallas delta + zeros" (one kernel
writing both). Each row: median device time (us), end-to-end (us), GB/s of the bytes it
must move, the max abs difference from the einsum's delta, and whether `jax.vmap` over
two such inputs gives the first one's delta bit for bit ("vmap same"): under vmap the
backward computes delta over arrays with one more axis, and a reduction that XLA tiles
by the arrays' shape may round otherwise. --o-dtype float32 takes O as the Hopper
backward does for 16-bit inputs (the forward's float32 O, `api._forward`); dO stays
bfloat16.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import harness
from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax.attention.logits import row_delta

_BLOCK_T = 64


def _sum_then_transpose(o, do):
  d = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # (B, T, N)
  return d.transpose(0, 2, 1)


def _pallas_delta(o, do, *, zeros: bool):
  """delta (B, N, T), and with ``zeros`` a zeroed float32 array of o's shape, from
  one kernel: a program per head, block of _BLOCK_T rows and batch row. T must be a
  multiple of _BLOCK_T and H a power of two (a prototype: no masks)."""
  B, T, N, H = o.shape
  rows = pl.BlockSpec((None, _BLOCK_T, None, H), lambda n, t, b: (b, t, n, 0))
  out_specs = [pl.BlockSpec((None, None, _BLOCK_T), lambda n, t, b: (b, n, t))]
  out_shape = [jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
  if zeros:
    out_specs.append(rows)
    out_shape.append(jax.ShapeDtypeStruct(o.shape, jnp.float32))

  def kernel(o_ref, do_ref, delta_ref, *zero_ref):
    prod = o_ref[...].astype(jnp.float32) * do_ref[...].astype(jnp.float32)
    delta_ref[...] = jnp.sum(prod, axis=1)
    for ref in zero_ref:
      ref[...] = jnp.zeros(ref.shape, jnp.float32)

  outs = pallas.pallas_call(
      kernel, name="delta_pallas", grid=(N, T // _BLOCK_T, B), in_specs=[rows, rows],
      out_specs=out_specs, out_shape=out_shape, num_warps=4, num_stages=2,
      interpret=pallas.resolve_interpret(None))(o, do)
  return tuple(outs) if zeros else outs[0]


def _delta(out):
  """A variant's delta: its output, or the first of its outputs."""
  return out[0] if isinstance(out, tuple) else out


def _zeros(o, do):
  del do
  return jnp.zeros(o.shape, jnp.float32)


def _einsum_and_zeros(o, do):
  return row_delta(o, do), jnp.zeros(o.shape, jnp.float32)


VARIANTS = {
    "einsum bnt": (row_delta, False),
    "sum btn then transpose": (_sum_then_transpose, False),
    "pallas delta": (functools.partial(_pallas_delta, zeros=False), False),
    "zeros": (_zeros, True),
    "einsum + zeros": (_einsum_and_zeros, True),
    "pallas delta + zeros": (functools.partial(_pallas_delta, zeros=True), True),
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", action="append",
                      help="B,T,N,H (default 4,4096,16,128 and 1,16384,32,128)")
  parser.add_argument("--o-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                      help="O's dtype (the Hopper backward reads a float32 O)")
  args = parser.parse_args()
  o_dtype = jnp.dtype(args.o_dtype)
  shapes = [tuple(int(x) for x in s.split(",")) for s in
            (args.shape or ["4,4096,16,128", "1,16384,32,128"])]
  if jax.default_backend() != "gpu":
    shapes = [(1, 128, 2, 64)]
  print(f"# bench_delta on {jax.devices()[0].device_kind}, JAX {jax.__version__}")
  for shape in shapes:
    B, T, N, H = shape
    sets = []
    in_bytes = np.prod(shape) * (o_dtype.itemsize + 2)
    for i in range(max(2, harness.rotations(in_bytes))):  # two at least, for vmap
      ko, kd = jax.random.split(jax.random.key(i))
      sets.append((jax.random.normal(ko, shape, jnp.float32).astype(o_dtype),
                   jax.random.normal(kd, shape, jnp.bfloat16)))
    truth = jax.jit(row_delta)(*sets[0])
    pair = tuple(jnp.stack(x) for x in zip(sets[0], sets[1]))  # two inputs on a new axis
    print(f"\n## B, T, N, H = {shape}, O {o_dtype.name}, dO bfloat16\n")
    print("| variant | device us | end-to-end us | GB/s | max abs diff from einsum "
          "| vmap same |")
    print("|---|---|---|---|---|---|")
    for name, (fn, writes_zeros) in VARIANTS.items():
      if name.startswith("pallas") and shape[1] % _BLOCK_T:
        print(f"| {name} | | | | (T not a multiple of {_BLOCK_T}) | |")
        continue
      moved = (0 if name == "zeros" else in_bytes) + (4 * np.prod(shape) if writes_zeros else 0)
      out = jax.jit(fn)(*sets[0])
      delta = _delta(out)
      diff = "-" if name == "zeros" else f"{float(jnp.max(jnp.abs(delta - truth))):.2e}"
      if isinstance(out, tuple) and not bool(jnp.all(out[1] == 0)):
        diff += " (zeros not zero)"
      same = "-"
      if name != "zeros":
        mapped = _delta(jax.jit(jax.vmap(fn))(*pair))[0]
        mismatches = int(jnp.sum(mapped != delta))
        same = "yes" if mismatches == 0 else f"no: {mismatches} of {delta.size} differ"
      device, wall, timer = harness.time_call(fn, sets)
      print(f"| {name} | {device:.1f} | {wall:.1f} | {moved / device / 1e3:.0f} | {diff} "
            f"| {same} |", flush=True)
    print(f"\n(timer: {timer})")


if __name__ == "__main__":
  main()
