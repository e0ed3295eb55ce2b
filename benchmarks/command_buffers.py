"""What XLA's command buffers (CUDA graphs) do for a training step on our kernels.

    PYTHONPATH=.:benchmarks python3 benchmarks/command_buffers.py --out DIR

XLA captures runs of at least ``--xla_gpu_graph_min_graph_size`` capturable operations
of a compiled program into command buffers, replayed with one launch each; operations
it cannot capture split the runs and launch one by one. The training step of
examples/train_transformer.py (our attention, norms in jnp, linear_cross_entropy; an
Adam update) at two sizes, the example's GPU size and a launch-bound one (many thin
layers, few tokens), each compiled twice in a fresh process: with XLA's default command
buffer types and with command buffers off (``--xla_gpu_enable_command_buffer=``). Per
run: the median of the wall time per step over 30 steps issued back to back, and, from
XLA's dump of the program after its thunk passes (``--xla_dump_to``), how many thunks
ran inside command buffers and how many outside, by kind. Writes
DIR/command_buffers.log.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = {
    "example (4 layers, dim 1024, 8 x 2048 tokens)":
        dict(layers=4, dim=1024, heads=8, kv_heads=2, head_dim=128, batch=8, seq=2048,
             vocab=32000),
    "launch-bound (16 layers, dim 256, 2 x 256 tokens)":
        dict(layers=16, dim=256, heads=2, kv_heads=2, head_dim=128, batch=2, seq=256,
             vocab=8192),
}
MODES = {"default": "", "off": "--xla_gpu_enable_command_buffer="}


def _step_time(size: dict) -> float:
  """Median wall ms per step of the example's jitted training step, steps pipelined."""
  import jax
  import jax.numpy as jnp
  import optax

  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
  import train_transformer as demo

  import jaxsoftmax as js
  loss = demo.make_model(lambda q, k, v: js.dot_product_attention(q, k, v, is_causal=True),
                         js.linear_cross_entropy, heads=size["heads"],
                         kv_heads=size["kv_heads"], head_dim=size["head_dim"],
                         attn_dtype=jnp.bfloat16)
  optimizer = optax.adam(1e-4)

  @jax.jit
  def step(params, opt_state, tokens):
    grads = jax.grad(loss)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = demo.init_params(jax.random.PRNGKey(0), vocab=size["vocab"], dim=size["dim"],
                            heads=size["heads"], kv_heads=size["kv_heads"],
                            head_dim=size["head_dim"], layers=size["layers"], seq=size["seq"])
  state = (params, optimizer.init(params))
  tokens = demo.copy_task(jax.random.PRNGKey(1), batch=size["batch"], seq=size["seq"],
                          vocab=size["vocab"])(0)
  for _ in range(3):
    state = jax.block_until_ready(step(*state, tokens))
  times = []
  for _ in range(3):
    start = time.perf_counter()
    for _ in range(10):
      state = step(*state, tokens)
    jax.block_until_ready(state)
    times.append((time.perf_counter() - start) / 10 * 1e3)
  return statistics.median(times)


def _thunks(dump_dir: str, keep: str) -> dict:
  """How often each thunk kind appears in the dumped step program (the largest thunk
  sequence after XLA's thunk passes; the kinds inside command buffers are listed under
  their kCommandBuffer), which is copied to ``keep`` to be read."""
  files = glob.glob(f"{dump_dir}/*thunk_sequence_after_thunk_passes*")
  if not files:
    return {"note": "no thunk sequence in the dump"}
  text = open(max(files, key=os.path.getsize)).read()
  with open(keep, "w") as f:
    f.write(text)
  counts: dict = {}
  for kind in re.findall(r"\bk[A-Z][A-Za-z]+\b", text):
    counts[kind] = counts.get(kind, 0) + 1
  return counts


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=".")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:  # one size, in a process of its own (XLA_FLAGS are read at start)
    print(json.dumps({"ms": _step_time(SIZES[args.child])}))
    return
  os.makedirs(args.out, exist_ok=True)
  lines = []
  for size in SIZES:
    for mode, flag in MODES.items():
      with tempfile.TemporaryDirectory() as dump:
        flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), flag,
                                     f"--xla_dump_to={dump}") if f)
        run = subprocess.run([sys.executable, __file__, "--child", size],
                             env=dict(os.environ, XLA_FLAGS=flags), capture_output=True,
                             text=True)
        if run.returncode:
          lines.append(f"{size} | {mode}: failed: {run.stderr.strip().splitlines()[-1:]}")
        else:
          ms = json.loads(run.stdout.strip().splitlines()[-1])["ms"]
          keep = os.path.join(args.out, f"thunks_{list(SIZES).index(size)}_{mode}.txt")
          lines.append(f"{size} | command buffers {mode}: {ms:.3f} ms/step | "
                       f"thunks {_thunks(dump, keep)}")
      print(lines[-1], flush=True)
  with open(os.path.join(args.out, "command_buffers.log"), "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
