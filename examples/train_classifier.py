"""Train a small classifier with jaxsoftmax's cross-entropy, beside the same model with optax's.

    examples/run                      # sets up .venv, then runs this script
    python examples/train_classifier.py --steps 50 --classes 1000

Both models start from the same weights and see the same batches. Each step is one jitted
update: forward, `jax.grad` through the loss's custom VJP (our backward kernel, or
optax's autodiff), and an Adam update. Printed: each step's two losses and the largest
difference of their gradients, then a table of final errors and median step times. On a
CPU the kernels run in Pallas interpret mode, so the default size there is tiny; on a GPU
the default is a vocabulary-sized problem.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsoftmax as js


def make_data(key, n_classes: int, dim: int, batch: int):
  """Batches of points around one random centre per class: a learnable problem."""
  centres = jax.random.normal(key, (n_classes, dim))

  def batch_at(step):
    k_label, k_noise = jax.random.split(jax.random.fold_in(key, step))
    labels = jax.random.randint(k_label, (batch,), 0, n_classes)
    return centres[labels] + jax.random.normal(k_noise, (batch, dim)), labels

  return batch_at


def init_mlp(key, dim: int, hidden: int, n_classes: int):
  k1, k2 = jax.random.split(key)
  return {
      "w1": jax.random.normal(k1, (dim, hidden)) / np.sqrt(dim),
      "b1": jnp.zeros(hidden),
      "w2": jax.random.normal(k2, (hidden, n_classes)) / np.sqrt(hidden),
      "b2": jnp.zeros(n_classes),
  }


def logits_of(params, x):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  return h @ params["w2"] + params["b2"]


LOSSES = {
    "jaxsoftmax": lambda logits, y: js.cross_entropy(logits, y),
    "optax": lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
}


def make_step(loss_fn, optimizer):
  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(logits_of(p, x), y))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  return step


def main():
  on_gpu = jax.default_backend() == "gpu"
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--classes", type=int, default=32000 if on_gpu else 10)
  parser.add_argument("--batch", type=int, default=4096 if on_gpu else 256)
  parser.add_argument("--dim", type=int, default=256 if on_gpu else 16)
  parser.add_argument("--hidden", type=int, default=1024 if on_gpu else 64)
  args = parser.parse_args()
  print(f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; kernels "
        f"{'compiled' if on_gpu else 'interpreted (no GPU)'}; batch {args.batch}, "
        f"{args.classes} classes, {args.steps} steps")

  key_data, key_init = jax.random.split(jax.random.PRNGKey(0))
  batch_at = make_data(key_data, args.classes, args.dim, args.batch)
  optimizer = optax.adam(1e-2)
  params0 = init_mlp(key_init, args.dim, args.hidden, args.classes)
  states = {name: (params0, optimizer.init(params0)) for name in LOSSES}
  steps = {name: make_step(fn, optimizer) for name, fn in LOSSES.items()}
  times = {name: [] for name in LOSSES}
  worst_loss_gap = worst_grad_gap = 0.0

  print(f"{'step':>5} {'loss (ours)':>12} {'loss (optax)':>13} {'max |grad diff|':>16}")
  for step in range(args.steps):
    x, y = batch_at(step)
    results = {}
    for name in LOSSES:
      start = time.perf_counter()
      out = jax.block_until_ready(steps[name](*states[name], x, y))
      times[name].append(time.perf_counter() - start)
      states[name] = out[:2]
      results[name] = out[2:]
    (loss, grads), (loss_ref, grads_ref) = results["jaxsoftmax"], results["optax"]
    grad_gap = max(float(jnp.max(jnp.abs(a - b)))
                   for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)))
    worst_loss_gap = max(worst_loss_gap, abs(float(loss) - float(loss_ref)))
    worst_grad_gap = max(worst_grad_gap, grad_gap)
    if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
      print(f"{step:5d} {float(loss):12.5f} {float(loss_ref):13.5f} {grad_gap:16.2e}")

  x, y = batch_at(args.steps)
  final_logits = logits_of(states["jaxsoftmax"][0], x)
  accuracy = float(jnp.mean(jnp.argmax(final_logits, -1) == y))
  prob_gap = float(jnp.max(jnp.abs(js.softmax(final_logits) - jax.nn.softmax(final_logits))))
  # The first step compiles; the median of the rest is the step time.
  median_ms = {name: 1e3 * statistics.median(t[1:] or t) for name, t in times.items()}
  print()
  print("| check                                   | value    |")
  print("|-----------------------------------------|----------|")
  print(f"| max |loss - optax loss| over steps      | {worst_loss_gap:.2e} |")
  print(f"| max |grad - optax grad| over steps      | {worst_grad_gap:.2e} |")
  print(f"| max |softmax - jax.nn.softmax|, final   | {prob_gap:.2e} |")
  print(f"| accuracy of the trained model           | {accuracy:8.3f} |")
  print(f"| median step, jaxsoftmax (ms, wall)      | {median_ms['jaxsoftmax']:8.2f} |")
  print(f"| median step, optax (ms, wall)           | {median_ms['optax']:8.2f} |")


if __name__ == "__main__":
  main()
