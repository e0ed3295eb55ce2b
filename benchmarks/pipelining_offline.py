"""Which loads Triton pipelines in our Triton attention kernels, on a machine without a
GPU: each kernel of one call is lowered as the GPU machine lowers it (JAX 0.11.2's Pallas,
for an H200) and compiled to PTX by the `triton` package for sm_90 with the kernel's own
num_warps and num_stages; the report counts, per kernel, the asynchronous copies
(cp.async: the loads the software pipeliner took) beside the plain global loads and the
wgmma instructions, with the shared memory a program of it takes.

    bash benchmarks/resources_offline.sh --pipelining --feature mask 1,1024,2,2,128,0

(resources_offline.sh sets up the venv: JAX 0.11.2 with its CUDA plugin, and `triton`.)
The registry's Triton is not the one inside XLA, so the figures are a reading of the
pipeliner's decisions, not of the GPU machine's binary. It found (2026-12-05) that a
mask array's kernels pipelined nothing while a conditional in their walks skipped the
tiles the mask masks entirely (the pipeliner takes only a loop's top-level loads); the
walks now narrow their ranges instead (docs/kernels.md, mask arrays).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import tempfile

import jax
import jax.numpy as jnp

import jaxsoftmax as js
from jaxsoftmax.attention import BlockSizes
import harness
from bench_attention_features import FEATURES, feature_arrays


def triton_modules(shape: str, feature: str | None, mode: str,
                   forward_tiles: str | None = None) -> list[tuple[str, str, int, int]]:
  """(name, Triton IR text, num_stages, num_warps) of each Triton kernel that one call
  at ``shape`` (B,T,N,K,H,causal) lowers to, in the lowered program's order;
  ``forward_tiles`` ("block_q,block_k,num_warps,num_stages") replaces the forward's
  default tiles."""
  from jax._src.pallas.triton import lowering
  harness.lower_as_if_on_an_h200()
  modules = []
  lower = lowering.lower_jaxpr_to_triton_module

  def recording(*args, **kwargs):
    result = lower(*args, **kwargs)
    text = result.module.operation.get_asm(enable_debug_info=False)
    modules.append((re.search(r"tt.func public @(\w+)", text).group(1), text))
    return result

  lowering.lower_jaxpr_to_triton_module = recording
  B, T, N, K, H, causal = (int(x) for x in shape.split(","))
  kw = feature_arrays(feature, B, T, N)[0] if feature else {}
  if forward_tiles:
    bq, bk, warps, stages = (int(x) for x in forward_tiles.split(","))
    kw["block_sizes"] = dataclasses.replace(
        BlockSizes.default(T, T, H, jnp.bfloat16, bool(causal)), block_q=bq, block_k=bk,
        num_warps=warps, num_stages=stages)
  attention = functools.partial(js.dot_product_attention, is_causal=bool(causal),
                                implementation="triton", interpret=False, **kw)
  x = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
  q, kv = x((B, T, N, H)), x((B, T, K, H))
  if mode == "fwd":
    traced = jax.jit(attention).trace(q, kv, kv)
  elif mode == "jvp":  # the forward, then the tangent kernel
    traced = jax.jit(lambda q, k, v: jax.jvp(attention, (q, k, v), (q, k, v))).trace(
        q, kv, kv)
  else:
    traced = jax.jit(lambda q, k, v, do: jax.vjp(attention, q, k, v)[1](do)).trace(
        q, kv, kv, q)
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  lowering.lower_jaxpr_to_triton_module = lower
  # Each kernel's launch parameters, in the lowered program's order.
  params = re.findall(r'name = \\?"(attention_\w+)\\?", num_stages = (\d+) : i32, '
                      r'num_warps = (\d+) : i32', text)
  return [(name, ir, int(stages), int(warps))
          for (name, ir), (_, stages, warps) in zip(modules, params, strict=True)]


def pipelining(ir: str, num_warps: int, num_stages: int) -> dict[str, int]:
  """Counts in the PTX that `triton` compiles ``ir`` to for sm_90."""
  import triton
  from triton.backends.compiler import GPUTarget
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.ttir")
    with open(path, "w") as f:
      f.write(ir)
    compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
  ptx = compiled.asm["ptx"]
  return {"cp.async": len(re.findall(r"cp\.async\.c[ag]", ptx)),
          "ld.global": len(re.findall(r"ld\.global", ptx)),
          "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
          "shared bytes": compiled.metadata.shared}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("shapes", nargs="+", help="B,T,N,K,H,causal")
  parser.add_argument("--feature", choices=FEATURES[1:])
  parser.add_argument("--mode", default="fwd+bwd", choices=("fwd", "fwd+bwd", "jvp"))
  parser.add_argument("--forward-tiles", help="block_q,block_k,num_warps,num_stages of the "
                      "forward, in place of its defaults")
  args = parser.parse_args()
  for shape in args.shapes:
    for name, ir, stages, warps in triton_modules(shape, args.feature, args.mode,
                                                    args.forward_tiles):
      counts = pipelining(ir, warps, stages)
      # A call with a mask also compiles the kernels of its lengths forms (api.py,
      # `_mask_as_lengths`); the mask array's own read a tile of int8.
      tiles = " with the mask tile" if "ptr<i8>" in ir else ""
      print(f"{shape} {args.feature or 'plain'} {name}{tiles} (warps {warps}, stages "
            f"{stages}): " + ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)


if __name__ == "__main__":
  main()
