"""Why the H = 8192 GPU tests of linear_cross_entropy run 2002 rows: float32 accumulation
error of the logits' products, against the float64 truth, on the GPU.

    PYTHONPATH=.:benchmarks python3 benchmarks/accuracy_linear_cross_entropy.py --out DIR

For rows x H in {70, 2048} x {4096, 8192} (V = 3001, bfloat16, the GPU tests' inputs and
loss terms, no bias): XLA's bfloat16 product with float32 logits (largest error, mean
error toward zero, rms), then the per-row loss of our two kernel backends' forwards
(`implementation="mosaic_gpu"`, `"triton"`) beside the pure-jnp reference on XLA's
product (largest and mean error). Both
our kernels run one float32 accumulation chain of H over the tensor cores, which round
their sums toward zero; at few rows XLA's product splits H (split-K) and its error falls
several times below any unsplit product's, XLA's own at 2048 rows included. Writes
DIR/accuracy_linear_cross_entropy.log and prints it.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import harness
import jaxsoftmax as js
from jaxsoftmax.cross_entropy import reference

OPTIONS = dict(label_smoothing=0.1, z_loss=1e-4, logit_soft_cap=30.0)
V = 3001


def _inputs(rows: int, H: int):
  """The GPU tests' inputs (tests/test_linear_cross_entropy.py, `_inputs`, key 0): unit
  hidden, logits of standard deviation 3, row 3 ignored (its loss is 0)."""
  kx, kw, _, ky = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(kx, (rows, H), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (H, V), jnp.float32) / np.sqrt(H) * 3).astype(jnp.bfloat16)
  y = jax.random.randint(ky, (rows,), 0, V).at[3].set(-100)
  return x, w, y


def _reference(x, w, y):
  logits = jnp.dot(x, w, preferred_element_type=jnp.promote_types(x.dtype, jnp.float32))
  c = OPTIONS["logit_soft_cap"]
  logits = c * jnp.tanh(logits / c)
  return reference.cross_entropy(logits, y, reduction="none", label_smoothing=0.1,
                                 z_loss=1e-4)


def measure(rows: int, H: int) -> list[str]:
  x, w, y = _inputs(rows, H)
  z = np.asarray(jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))(
      x, w), np.float64)
  z64 = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  e = z - z64
  lines = [f"rows {rows} H {H}: XLA logits max|err| {np.abs(e).max():.2e} "
           f"mean err*sign(z) {np.mean(e * np.sign(z64)):.2e} rms {np.sqrt(np.mean(e**2)):.2e}"]
  with jax.enable_x64(True):
    exact = np.asarray(_reference(jnp.asarray(np.asarray(x, np.float64)),
                                  jnp.asarray(np.asarray(w, np.float64)), y))
  ours_ref = np.asarray(jax.jit(_reference)(x, w, y), np.float64)
  ref_err = ours_ref - exact
  for implementation in ("mosaic_gpu", "triton"):
    got = np.asarray(jax.jit(lambda x, w: js.linear_cross_entropy(
        x, w, y, reduction="none", implementation=implementation, **OPTIONS))(x, w),
        np.float64)
    err = got - exact
    lines.append(f"   {implementation:10s} per-row loss max|err| {np.abs(err).max():.2e} "
                 f"mean err {np.mean(err):+.2e}   xla ref max|err| {np.abs(ref_err).max():.2e} "
                 f"mean {np.mean(ref_err):+.2e}")
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=".", help="directory of the log")
  args = parser.parse_args()
  lines = [line for rows, H in [(70, 8192), (2048, 8192), (70, 4096), (2048, 4096)]
           for line in measure(rows, H)]
  harness.write_lines(args.out, "accuracy_linear_cross_entropy.log", lines)


if __name__ == "__main__":
  main()
