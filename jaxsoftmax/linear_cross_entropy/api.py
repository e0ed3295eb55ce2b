"""Linear layer + softmax cross-entropy in Pallas kernels that never write the logits.

For rows x (R, H) of ``hidden``, ``weight`` W (H, V) and optional ``bias`` b, the logits
z = x W + b (float32 accumulation) become s = c·tanh(z / c) under a soft cap c (Gemma 2),
else s = z; with the row's lse = log Σ_j exp(s_j), label y, smoothing a and z-loss
coefficient ζ, the loss is that of `jaxsoftmax.cross_entropy` on s:

    loss = lse - (1 - a)·s_y - a·mean_j s_j + ζ·lse²

Forward kernel: one program per (block of rows, range of the vocabulary). It walks the
range in vocabulary tiles; each logit tile is a sum over hidden-dim chunks of
x-chunk · W-chunk products on the tensor cores, and never leaves registers: the program
keeps the online-softmax state (m, l), the label's logit and Σ s_j per row, and writes
those four numbers per row for its range. The ranges merge in float32 (the
`merge_states` rule), so nothing R x V reaches memory.

Backward: the gradient with respect to the logits is

    ds = g·[(1 + 2ζ·lse)·p - (1 - a)·[j = y] - a / V] + g_lse·p,   p = exp(s - lse)

(times 1 - (s/c)² under a soft cap), then dhidden = ds · Wᵀ, dweight = xᵀ · ds and
dbias = Σ_rows ds. p is formed as exp((s - m) - log l) from the forward's merged state,
not from lse = m + log l, whose float32 rounding would cost p up to half an ulp of lse
(the forward saves both).

The backward (`chunked`) walks the vocabulary in chunks of ``chunk_vocab`` columns; per
chunk, XLA's matrix products (cuBLAS on a GPU) recompute its logits in float32 and form
its dweight columns (complete: every row contributes) and its share of a float32
dhidden, with ds formed in between and rounded to the inputs' dtype (in float16 scaled
and as two terms, `logits.operand_terms`). A T x chunk block of logits and of ds is the
only buffer beyond the gradients and the float32 dhidden. Deterministic. For float32
inputs it first recomputes each row's softmax state from its own products (one more
product), so that p sums to 1 over the logits it differentiates. A backend may form each
chunk's ds in its own kernel instead: the Hopper one for bfloat16 without a bias (the
forward's products with ds in their epilogue, written in bfloat16, no float32 logits
between them).

Backends (`REGISTRY`, the rule of `jaxsoftmax._core.backends`; each a module with
`call.LinearCrossEntropyBackend`'s entry points), fastest first:

- "mosaic_gpu": a Hopper GPU's tensor cores through Pallas Mosaic GPU, bfloat16 and
  float16 (wgmma products fed by TMA from a warp-specialized producer, the
  online-softmax update as their epilogue; the label's logit and, without a soft cap,
  Σ_j s come from XLA beside it), and its ds kernel. On the H200, each on its default
  tiles, the forward ran at 1.04x-1.07x the time of cuBLAS's bfloat16 product alone,
  1.44x-1.50x faster than the Triton kernel
  (`benchmarks/results/tuning/tune_linear_cross_entropy_hopper.md`,
  `tune_linear_cross_entropy_hopper_gemma.md`). Interpreted only when named.
- "triton": the Triton forward above, any floating dtype, interpret mode's default;
  compiled float32 only when named (its products run as IEEE FMAs, off the tensor cores).
- "xla_chunks": the forward as XLA's products (cuBLAS), one vocabulary chunk at a time,
  the chunks' states merged (`chunked.chunk_states`): float32's default on a GPU.
- ``implementation="xla"`` is the reference (`reference`): XLA's logits and
  `jaxsoftmax.cross_entropy`.

Two Pallas backwards that recomputed the logit tiles in the kernels (float32 atomic
adds; or a dhidden and a dweight kernel) measured 5.4x-8x slower than XLA's unfused loss
on the H200 (their updates of float32 accumulators in global memory, per tile,
dominated) and were removed (docs/kernels.md).

FLOPs: forward 2·R·H·V; backward 6·R·H·V (logits again, dhidden, dweight), 8·R·H·V for
float32 after the Triton forward (its own softmax state first).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxsoftmax._core import pallas
from jaxsoftmax._core.backends import Registry, check_implementation
from jaxsoftmax._core.inputs import check_floating
from jaxsoftmax._core.linear_map import LinearMap
from jaxsoftmax.cross_entropy.api import REDUCTIONS, check_labels, reduce_losses
from jaxsoftmax.linear_cross_entropy import (chunked, mosaic_gpu, reference, triton,
                                             xla_chunks)
from jaxsoftmax.linear_cross_entropy.call import Call, LinearCrossEntropyBackend
from jaxsoftmax.linear_cross_entropy.logits import Options, Rows
from jaxsoftmax.linear_cross_entropy.tiling import Dims, LinearCrossEntropyTiling

__all__ = ["linear_cross_entropy", "REGISTRY", "IMPLEMENTATIONS"]

# Kernel backends in order of preference (fastest first, where each can run a call).
REGISTRY: Registry[LinearCrossEntropyBackend] = Registry(
    "linear_cross_entropy", (mosaic_gpu, triton, xla_chunks),
    otherwise="implementation='xla' takes the reference path")
IMPLEMENTATIONS = REGISTRY.implementations


def _loss(lse, label_logit, total, labels, dims: Dims, options: Options):
  a = options.label_smoothing
  # Terms with a zero coefficient are left out, as the reference does: with infinite
  # logits they would make 0·inf = NaN where the loss is +inf.
  loss = lse - (1 - a) * label_logit
  if a:
    loss = loss - a * total / dims.V
  if options.z_loss:
    loss = loss + options.z_loss * lse * lse
  in_range = (labels >= 0) & (labels < dims.V)
  return jnp.where(in_range, loss, jnp.nan)  # ignored rows are zeroed by the caller

# --- derivatives: reverse mode on the kernels, a clear error otherwise ------------------
# The (loss, lse) tangent is a linear map of (dhidden, dweight[, dbias]) whose transpose
# is the backward (`chunked.backward`); reverse mode only transposes it. Evaluating it (forward
# mode) or differentiating it again (second order) would need the logits' own
# derivatives, which these kernels never form: both raise this.
_REVERSE_ONLY = (
    "linear_cross_entropy is differentiable in reverse mode (jax.grad, jax.vjp) only: "
    "forward mode (jax.jvp, jax.jacfwd, jax.linearize) and second derivatives "
    "(jax.hessian, jvp of grad) are not supported by its fused kernels. For those, form "
    "the logits and use cross_entropy, which supports every mode: "
    "cross_entropy(jnp.dot(hidden, weight, preferred_element_type=jnp.float32), labels)")

def _tangent_kernel(res, t, *, call: Call, backend: str):
  raise NotImplementedError(_REVERSE_ONLY)

def _tangent_types(res, t, *, call: Call, backend: str):
  del t, call, backend
  m = res[4]  # (R,) float32, varying over the mesh axes the inputs vary over
  return m, m

def _transpose_kernel(res, cts, *, call: Call, backend: str):
  x, w, b, labels, m, log_l = res
  g, g_lse = cts
  # Rows with a label out of range (possible only inside jit) give NaN gradients.
  in_range = (labels >= 0) & (labels < call.dims.V)
  g = jnp.where(in_range | (g == 0), g.astype(jnp.float32), jnp.nan)
  rows = Rows(labels, m, log_l, g, g_lse.astype(jnp.float32))
  chosen = REGISTRY[backend]
  dx, dw, db = chunked.backward(x, w, b, rows, call.dims, call.options,
                                chunk_ds=chosen.chunk_ds(x, rows, call),
                                state_from_xla=chosen.STATE_FROM_XLA)
  return (dx.astype(x.dtype), dw.astype(w.dtype)) + (() if b is None else
                                                     (db.astype(b.dtype),))

def _transpose_types(res, cts, *, call: Call, backend: str):
  del cts, call, backend
  x, w, b = res[:3]
  return (x, w) + (() if b is None else (b,))

# The weight is no row's own: under vmap the maps run once per batch element.
_TANGENT = LinearMap("linear_cross_entropy_tangent", kernel=_tangent_kernel, twin=None,
                     out_types=_tangent_types, no_twin=_REVERSE_ONLY,
                     fold_rows=lambda **_: False).pair(
    LinearMap("linear_cross_entropy_transpose", kernel=_transpose_kernel, twin=None,
              out_types=_transpose_types, no_twin=_REVERSE_ONLY, fold_rows=lambda **_: False))

@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _state(x, w, b, labels, call: Call, backend: str):
  """(loss, lse, m, log l) of each row: the losses and the residuals of the backward, from
  the forward of the backend named ``backend``. Differentiated only at second order
  (`_losses_and_lse` differentiates the losses): an error."""
  m, log_l, label_logit, total = REGISTRY[backend].forward(x, w, b, labels, call)
  lse = m + log_l
  return _loss(lse, label_logit, total, labels, call.dims, call.options), lse, m, log_l

@_state.defjvp
def _state_jvp(call: Call, backend: str, primals, tangents):
  raise NotImplementedError(_REVERSE_ONLY)

@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _losses_and_lse(x, w, b, labels, call: Call, backend: str):
  return _state(x, w, b, labels, call, backend)[:2]

@_losses_and_lse.defjvp
def _losses_and_lse_jvp(call: Call, backend: str, primals, tangents):
  x, w, b, labels = primals
  loss, lse, m, log_l = _state(x, w, b, labels, call, backend)
  t = tuple(tangents[:2]) + (() if b is None else (tangents[2],))
  return (loss, lse), _TANGENT((x, w, b, labels, m, log_l), t, call=call, backend=backend)

def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         logit_soft_cap: float | None = None, reduction: str = "mean",
                         return_lse: bool = False, implementation: str | None = None,
                         tiling: LinearCrossEntropyTiling | None = None,
                         interpret: bool | None = None):
  """Softmax cross-entropy of the logits ``hidden @ weight (+ bias)`` and integer
  ``labels``, without materializing the logits.

  The same numbers as `jaxsoftmax.cross_entropy` applied to
  ``jnp.dot(hidden, weight, preferred_element_type=jnp.float32) + bias`` (after
  ``logit_soft_cap``, if given).

  Args:
    hidden: (..., H) float32, bfloat16 or float16 (float64 takes the reference path).
    weight: (H, V), the dtype of ``hidden``.
    labels: integer class indices, ``hidden.shape[:-1]``.
    bias: optional (V,) logit bias, the dtype of ``hidden``.
    ignore_index, label_smoothing, z_loss, reduction, return_lse: as
      `jaxsoftmax.cross_entropy`.
    logit_soft_cap: c > 0: the logits become c·tanh(logits / c) first (Gemma 2).
    implementation: None (the first backend of `REGISTRY` that can run the call:
      "mosaic_gpu" for 16-bit inputs on a Hopper GPU, "xla_chunks" for float32 on a GPU,
      else "triton"; off a GPU the XLA path unless kernels are asked for), "mosaic_gpu",
      "triton", "xla_chunks" (XLA's products a vocabulary chunk at a time, no logits in
      memory), or "xla" (the reference: XLA's logits and `jaxsoftmax.cross_entropy`). A
      named backend that cannot run the call raises a ValueError saying why.
    tiling: optional `LinearCrossEntropyTiling`, the kernels' tiles.
    interpret: run the kernels in Pallas interpret mode; see `jaxsoftmax.softmax`.

  Returns:
    The float32 loss, or ``(loss, lse)`` with ``return_lse`` (lse per row, float32).
  """
  op = "linear_cross_entropy"
  hidden = check_floating(hidden, "hidden", op)
  weight = check_floating(weight, "weight", op)
  labels = jnp.asarray(labels)
  if hidden.ndim < 1 or weight.ndim != 2 or weight.shape[0] != hidden.shape[-1]:
    raise ValueError(f"{op}: hidden (..., H) and weight (H, V) must share H, got hidden "
                     f"{hidden.shape} and weight {weight.shape}")
  if weight.dtype != hidden.dtype:
    raise TypeError(f"{op}: weight must have the dtype of hidden ({hidden.dtype}), got "
                    f"{weight.dtype}")
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"{op}: labels must be integers, got {labels.dtype}")
  if labels.shape != hidden.shape[:-1]:
    raise ValueError(f"{op}: labels of shape {labels.shape} must have the shape of hidden "
                     f"without its last axis, {hidden.shape[:-1]}")
  H, V = weight.shape
  if V == 0:
    raise ValueError(f"{op}: weight must have a non-empty vocabulary, got shape "
                     f"{weight.shape}")
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (V,) or bias.dtype != hidden.dtype:
      raise ValueError(f"{op}: bias must have shape ({V},) and dtype {hidden.dtype}, got "
                       f"{bias.dtype} {bias.shape}")
  if reduction not in REDUCTIONS:
    raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
  if not 0.0 <= label_smoothing <= 1.0:
    raise ValueError(f"{op}: label_smoothing must lie in [0, 1], got {label_smoothing!r}")
  if z_loss < 0:
    raise ValueError(f"{op}: z_loss must be >= 0, got {z_loss!r}")
  if logit_soft_cap is not None and not logit_soft_cap > 0:
    raise ValueError(f"{op}: logit_soft_cap must be > 0, got {logit_soft_cap!r}")
  if tiling is not None and not isinstance(tiling, LinearCrossEntropyTiling):
    raise TypeError(f"{op}: tiling must be a LinearCrossEntropyTiling, got {tiling!r}")
  check_implementation(op, implementation, IMPLEMENTATIONS)
  check_labels(labels, V, ignore_index, op)
  kernel_asked = tiling is not None or implementation in REGISTRY.names
  if (implementation == "xla" or hidden.dtype == jnp.float64 or hidden.size == 0
      or labels.size == 0 or pallas.xla_by_default(interpret, kernel_asked=kernel_asked)):
    return reference.linear_cross_entropy(
        hidden, weight, labels, bias=bias, ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, logit_soft_cap=logit_soft_cap,
        reduction=reduction, return_lse=return_lse)

  flat_labels = labels.reshape(-1).astype(jnp.int32)
  dims = Dims(flat_labels.size, H, V, tiling or LinearCrossEntropyTiling())
  options = Options(float(label_smoothing), float(z_loss),
                    None if logit_soft_cap is None else float(logit_soft_cap),
                    bias is not None, pallas.resolve_interpret(interpret))
  call = Call(hidden.dtype.name, dims, options, named=implementation is not None)
  backend = REGISTRY.select(implementation, call).NAME
  hidden, weight, bias, flat_labels = pallas.vary_together(hidden, weight, bias, flat_labels)
  loss, lse = _losses_and_lse(hidden.reshape(-1, H), weight, bias, flat_labels, call,
                              backend)
  loss = reduce_losses(jnp.where(flat_labels != ignore_index, loss, 0.0), labels, None,
                       ignore_index, reduction)
  return (loss, lse.reshape(labels.shape)) if return_lse else loss
