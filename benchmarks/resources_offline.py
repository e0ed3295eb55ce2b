"""ptxas' registers and spills of our Hopper attention kernels, on a machine without a
GPU: what `bash benchmarks/run_gpu.sh attn-resources` reports, at no device time.

    bash benchmarks/resources_offline.sh 4,4096,16,16,128,1 [--schedule stale]

Run through resources_offline.sh, which sets up what this needs: JAX 0.11.2 (the GPU
machine's) with its CUDA plugin, ptxas, and a stand-in libcuda. Each shape
(B,T,N,K,H,causal as profile_attention.py's, with a value head dim Hv as a seventh
field where it differs from H; bfloat16 unless --dtype) is lowered for
CUDA on the CPU as a forward + backward of `dot_product_attention`
(implementation="mosaic_gpu"), and each Mosaic GPU kernel it holds is compiled for
sm_90a by the CUDA plugin's own pipeline (MosaicGpuCompile: the passes, LLVM's PTX,
ptxas), which stops at loading the binary, the one step that needs a device. ptxas'
report, per kernel: registers, bytes of spill stores and loads. --lengths gives the call
query and key lengths per batch row, as arrays (the kernels' ranges then come at run
time). --loops also compiles each kernel's dumped PTX with ptxas and disassembles it
(nvdisasm, from the triton wheel that resources_offline.sh installs), and prints the
innermost loops that issue wgmma (HGMMA): their SASS instructions, HGMMAs, exp2s
(MUFU.EX2), barrier or synchronization instructions, and local loads and stores (LDL,
STL: the spills that sit in the loop), so that two schedules' steady states compare
without a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import glob
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core as mosaic_core

import jaxsoftmax as js
from jaxsoftmax._core import mosaic_gpu as mosaic_device
from jaxsoftmax.attention.mosaic_gpu import backward as mosaic_backward
from jaxsoftmax.attention.mosaic_gpu import forward as mosaic_forward
import harness
from bench_attention_backward import parse_schedule


def kernel_modules(shape: str, deterministic: bool, dtype,
                   lengths: bool = False) -> list[bytes]:
  """The serialized Mosaic GPU modules that one forward + backward at ``shape`` lowers
  to (the CUDA lowering rule records each one it emits); with ``lengths``, given query
  and key lengths per batch row (known at run time only, as a padded batch's)."""
  B, T, N, K, H, causal, *value_dim = (int(x) for x in shape.split(","))
  Hv = value_dim[0] if value_dim else H
  x = functools.partial(jax.ShapeDtypeStruct, dtype=dtype)
  attention = functools.partial(js.dot_product_attention, is_causal=bool(causal),
                                implementation="mosaic_gpu", deterministic=deterministic,
                                interpret=False)

  def step(q, k, v, do, *lengths):
    call = functools.partial(attention, **dict(zip(
        ("query_seq_lengths", "key_value_seq_lengths"), lengths)))
    return jax.vjp(call, q, k, v)[1](do)

  mosaic_core.KNOWN_KERNELS.clear()
  length_args = (jax.ShapeDtypeStruct((B,), jnp.int32),) * 2 if lengths else ()
  jax.jit(step).trace(x((B, T, N, H)), x((B, T, K, H)), x((B, T, K, Hv)),
                      x((B, T, N, Hv)), *length_args).lower(lowering_platforms=("cuda",))
  return list(mosaic_core.KNOWN_KERNELS.values())


def compile_module(module: bytes):
  """Compiles one module with the CUDA plugin's MosaicGpuCompile (ptxas' report goes to
  MOSAIC_GPU_DUMP_TO); its loading step fails without a device, which is expected."""
  import jax_plugins.xla_cuda13 as cuda_plugin
  compile_fn = ctypes.CDLL(cuda_plugin._get_library_path()).MosaicGpuCompile
  compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
  compile_fn.restype = ctypes.c_void_p
  compile_fn(ctypes.c_char_p(module), ctypes.c_int(len(module)))


def innermost_wgmma_loops(sass: str) -> list[tuple[int, int, int, int, int, int]]:
  """(instructions, HGMMA, MUFU.EX2, barrier or sync instructions, local loads LDL and
  local stores STL: spills) of each loop of ``sass`` (nvdisasm's text) that issues
  HGMMA and holds no other loop: a backward branch's span from its target label."""
  labels, instructions = {}, []
  for line in sass.splitlines():
    label = re.match(r"\s*(\.L_x_\d+):", line)
    if label:
      labels[label.group(1)] = len(instructions)
    elif re.search(r"/\*[0-9a-f]{4,}\*/", line):  # an instruction's address
      instructions.append(line)
  spans = []
  for end, text in enumerate(instructions):
    target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
    if target and labels.get(target.group(1), end + 1) <= end:
      spans.append((labels[target.group(1)], end))
  loops = []
  for start, end in spans:
    if any(start <= s and e <= end and (s, e) != (start, end) for s, e in spans):
      continue  # holds another loop
    body = instructions[start:end + 1]
    count = lambda *words: sum(any(w in line for w in words) for line in body)
    if count("HGMMA"):
      loops.append((len(body), count("HGMMA"), count("MUFU.EX2"), count("BAR", "SYNCS"),
                    count("LDL"), count("STL")))
  return loops


def disassemble(ptx_path: str) -> str:
  """The SASS of one dumped PTX file, compiled for sm_90a as ptxas does by default."""
  cubin = ptx_path[:-len(".ptx")] + ".cubin"
  subprocess.run(["ptxas", "-arch=sm_90a", "-o", cubin, ptx_path], check=True,
                 capture_output=True)
  return subprocess.run(["nvdisasm", "-c", cubin], check=True, capture_output=True,
                        text=True).stdout


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("shapes", nargs="+", help="B,T,N,K,H,causal[,Hv]")
  parser.add_argument("--schedule", default="",
                      help="the Hopper backward's schedule (bench_attention_backward.py)")
  parser.add_argument("--forward", default="",
                      help="the forward's HopperBlockSizes fields to set: switches to turn "
                           "on and sizes, e.g. overlap_softmax,block_kv=256")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  parser.add_argument("--lengths", action="store_true",
                      help="query and key lengths per batch row, known at run time")
  parser.add_argument("--loops", action="store_true",
                      help="the SASS of each kernel's innermost wgmma loops")
  args = parser.parse_args()
  deterministic = False
  if args.schedule:
    mosaic_backward.BLOCKS, deterministic = parse_schedule(args.schedule)
  if args.forward:
    switches = {name: int(value[0]) if value else True
                for name, *value in (item.split("=") for item in args.forward.split(","))}
    default = mosaic_forward.HopperBlockSizes.default
    mosaic_forward.HopperBlockSizes.default = staticmethod(
        lambda *a, **k: dataclasses.replace(default(*a, **k), **switches))
  # Dispatch and lower as on an H200 (the backward's delta kernel is Triton's,
  # `triton.delta`): the kernels are lowered here, never run.
  mosaic_device.hopper_device = lambda: True
  harness.lower_as_if_on_an_h200()
  dump = tempfile.mkdtemp(prefix="ptxas")
  os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=dump)
  for shape in args.shapes:
    for module in kernel_modules(shape, deterministic, jnp.dtype(args.dtype), args.lengths):
      for old in glob.glob(f"{dump}/*.ptxas") + glob.glob(f"{dump}/*.ptx"):
        os.remove(old)
      compile_module(module)
      for path in glob.glob(f"{dump}/*.ptxas"):
        text = open(path).read()
        registers = re.search(r"Used (\d+) registers", text).group(1)
        stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                  text).groups()
        kernel = re.sub(r"_\d+$", "", os.path.basename(path).split(".")[0])
        # ptxas' C7513: it found registers a wgmma reads written while wgmmas were in
        # flight, and made every wgmma of the kernel wait for the one before.
        serialized = ", wgmma serialized (ptxas C7513)" * ("C7513" in text)
        print(f"{shape} {args.dtype}{' lengths' * args.lengths} {args.schedule or 'default'}"
              f"{' forward ' + args.forward if args.forward else ''} "
              f"{kernel}: {registers} registers, "
              f"spills {stores} bytes stored, {loads} loaded{serialized}", flush=True)
        if args.loops:
          for loop in innermost_wgmma_loops(disassemble(path[:-len(".ptxas")] + ".ptx")):
            print("  loop: %d instructions, %d HGMMA, %d MUFU.EX2, %d barrier/sync, "
                  "%d LDL, %d STL" % loop,
                  flush=True)


if __name__ == "__main__":
  main()
