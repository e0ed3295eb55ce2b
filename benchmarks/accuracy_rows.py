"""The row ops' accuracy beside XLA's over many inputs: is ours worse, or was one input
unlucky? On the GPU, forward and gradient errors against the float64 truth.

    PYTHONPATH=.:benchmarks python3 benchmarks/accuracy_rows.py --out DIR [--seeds 20]

For softmax, log_softmax, logsumexp and cross_entropy (reduction "none") on float32
logits spread like 4·N(0, 1) (the shapes (2, 5000), (64, 32000) and (8, 300000)): the
largest error of the output and of the gradient (for a random cotangent) against the
float64 truth, ours (the compiled kernels) and XLA's (jax.nn / optax, jitted), per
seed. Printed per op and shape: the median and largest ratio ours / XLA over the seeds,
and in how many seeds ours exceeds 2x XLA's (the test suite's rule holds ours to 2x a
same-dtype reference). Writes DIR/accuracy_rows.log.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsoftmax as js

SHAPES = [(2, 5000), (64, 32000), (8, 300_000)]


def _ops():
  ce = lambda fn: lambda x: fn(x, jnp.arange(x.shape[0]) % x.shape[1])
  return {
      "softmax": (js.softmax, jax.nn.softmax),
      "log_softmax": (js.log_softmax, jax.nn.log_softmax),
      "logsumexp": (lambda x: js.logsumexp(x, axis=-1),
                    lambda x: jax.nn.logsumexp(x, axis=-1)),
      "cross_entropy": (ce(lambda x, y: js.cross_entropy(x, y, reduction="none")),
                        ce(optax.softmax_cross_entropy_with_integer_labels)),
  }


def _errors(fn, x, ct, exact_out, exact_grad):
  out, vjp = jax.jit(lambda x: jax.vjp(fn, x))(x)
  grad = jax.jit(vjp)(ct)[0]
  err = lambda a, e: float(np.max(np.abs(np.asarray(a, np.float64) - e)))
  return err(out, exact_out), err(grad, exact_grad)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=".")
  parser.add_argument("--seeds", type=int, default=20)
  args = parser.parse_args()
  lines = []
  for name, (ours, xla) in _ops().items():
    for shape in SHAPES:
      ratios = {"output": [], "gradient": []}
      for seed in range(args.seeds):
        kx, kc = jax.random.split(jax.random.PRNGKey(seed))
        x = 4 * jax.random.normal(kx, shape, jnp.float32)
        out_shape = jax.eval_shape(xla, x).shape
        ct = jax.random.normal(kc, out_shape, jnp.float32)
        with jax.enable_x64(True):
          x64, ct64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (x, ct))
          out64, vjp64 = jax.vjp(xla, x64)
          exact_out, exact_grad = np.asarray(out64), np.asarray(vjp64(ct64)[0])
        ours_err = _errors(ours, x, ct, exact_out, exact_grad)
        xla_err = _errors(xla, x, ct, exact_out, exact_grad)
        for what, o, r in zip(ratios, ours_err, xla_err):
          ratios[what].append(o / max(r, 1e-30))
      for what, r in ratios.items():
        r = np.array(r)
        lines.append(f"{name:14s} {str(shape):16s} {what:8s} ours/XLA median {np.median(r):5.2f}"
                     f"  max {r.max():5.2f}  seeds above 2x: {int((r > 2).sum())}/{len(r)}")
        print(lines[-1], flush=True)
  header = (f"jax {jax.__version__} on {jax.devices()[0].device_kind}; float32 logits "
            f"4·N(0,1), {args.seeds} seeds; errors against float64")
  with open(os.path.join(args.out, "accuracy_rows.log"), "w") as f:
    f.write("\n".join([header] + lines) + "\n")


if __name__ == "__main__":
  main()
