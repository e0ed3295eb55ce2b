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
(the forward saves both). Three ways, ``LinearCrossEntropyTiling.backward``:

- "chunked" (the default): the vocabulary in chunks of ``chunk_vocab`` columns; per
  chunk, XLA's matrix products (cuBLAS on a GPU) recompute its logits in float32 and
  form its dweight columns (complete: every row contributes) and its share of a float32
  dhidden, with ds formed in between and rounded to the inputs' dtype. A T x chunk
  block of logits and of ds is the only buffer beyond the gradients and the float32
  dhidden. Deterministic. For bfloat16 without a bias on a Hopper GPU (by default, or
  ``dlogits="mosaic_gpu"``) one Pallas Mosaic GPU kernel forms each chunk's ds instead:
  the forward's products, ds in their epilogue, written in bfloat16
  (`mosaic_gpu.dlogits`), with no float32 logits between them.
- "atomic": one Pallas kernel per (block of rows, vocabulary tile) recomputes its logit
  tile and forms ds in registers, then adds ds · Wᵀ, xᵀ · ds and Σ_rows ds into float32
  accumulators with atomic adds (Cut Cross-Entropy's scheme, Wijmans et al. 2024).
- "two_kernels": a dhidden kernel over blocks of rows and a dweight kernel over
  vocabulary tiles, each recomputing the logit tiles and owning what it writes.

On the H200 the two kernel variants measured 6-8x slower than XLA's unfused loss (their
updates of the float32 accumulators in global memory, per tile, dominate); "chunked"
spends its time in the vendor's matrix products instead. ds enters every product in the
inputs' dtype (in float16 scaled and as two terms, `_operand_terms`).

The forward has two kernels, ``LinearCrossEntropyTiling.forward``: the Triton one above
(the default off Hopper GPUs and for float32, and the one interpret mode runs by
default) and a Hopper one in Pallas Mosaic GPU (`mosaic_gpu`: wgmma products fed by TMA
from a warp-specialized producer, the online-softmax update as their epilogue; the
label's logit and, without a soft cap, Σ_j s come from XLA beside it). On a Hopper GPU
it is the default for bfloat16 and float16: on the H200, each on its default tiles, it
ran at 1.04x-1.07x the time of cuBLAS's bfloat16 product alone, 1.44x-1.50x faster than the
Triton kernel (`benchmarks/results/tuning/tune_linear_cross_entropy_hopper.md`,
`tune_linear_cross_entropy_hopper_gemma.md`).

FLOPs: forward 2·R·H·V; backward 6·R·H·V (logits again, dhidden, dweight), 8·R·H·V with
two kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxsoftmax._core import mosaic_gpu as mosaic_device
from jaxsoftmax._core import pallas
from jaxsoftmax._core.inputs import check_floating
from jaxsoftmax._core.linear_map import LinearMap
from jaxsoftmax.cross_entropy.api import REDUCTIONS, check_labels, reduce_losses
from jaxsoftmax.linear_cross_entropy import chunked, mosaic_gpu, reference, triton
from jaxsoftmax.linear_cross_entropy.logits import Options, Rows, capped, merged_state
from jaxsoftmax.linear_cross_entropy.tiling import Dims, LinearCrossEntropyTiling

__all__ = ["linear_cross_entropy"]


def _forward(x, w, b, labels, dims: Dims, options: Options):
  """Per row, float32 (R,): the softmax state as its shift m and log l (`Rows`; lse =
  m + log l), the label's logit s_y and Σ_j s_j, from the forward kernel ``dims``
  names."""
  if dims.tiling.forward == "mosaic_gpu":
    return _forward_hopper(x, w, b, labels, dims, options)
  return triton.forward(x, w, b, labels, dims, options)


def _forward_hopper(x, w, b, labels, dims: Dims, options: Options):
  """`_forward` by the Hopper kernel (`mosaic_gpu`): the state from its ranges' states;
  the label's logit, and Σ_j s without a soft cap, from XLA's products beside it."""
  with_total = options.softcap is not None and options.label_smoothing > 0
  m, l, total = mosaic_gpu.forward(x, w, b, tiling=dims.tiling.hopper_tiling,
                                   softcap=options.softcap, with_total=with_total,
                                   interpret=options.interpret)
  m, log_l = merged_state(m, l)
  # s_y = cap(x_r · W[:, y_r] + b_y); an out-of-range label's row is NaN in `_loss`.
  y = jnp.clip(labels, 0, dims.V - 1)
  z_y = jnp.einsum("rh,hr->r", x, jnp.take(w, y, axis=1),
                   preferred_element_type=jnp.float32)
  if b is not None:
    z_y = z_y + b[y].astype(jnp.float32)
  s_y = capped(z_y, options)[0]
  if with_total:
    total = total.sum(axis=0)
  elif options.label_smoothing > 0:  # Σ_j z_j = x · (W 1) + Σ_j b_j
    total = jnp.dot(x, jnp.sum(w, axis=1, dtype=jnp.float32).astype(x.dtype),
                    preferred_element_type=jnp.float32)
    if b is not None:
      total = total + jnp.sum(b, dtype=jnp.float32)
  else:
    total = jnp.zeros_like(m)
  return m, log_l, s_y, total


def _backward(x, w, b, rows: Rows, dims: Dims, options: Options):
  """float32 (dx, dw, db or None)."""
  backward = dims.tiling.backward or ("two_kernels" if x.dtype == jnp.float32 else "chunked")
  if backward == "chunked":
    return chunked.backward(x, w, b, rows, dims, options)
  return triton.backward(x, w, b, rows, dims, options, atomic=backward == "atomic")


def _hopper_unsupported(dtype, tiling: LinearCrossEntropyTiling, interpret: bool):
  """Why the Hopper forward cannot run, or None. An explicit ``forward="mosaic_gpu"``
  runs interpreted off a GPU; the default is interpreted only as Triton (the interpreter
  that every kernel of this op has)."""
  why = mosaic_gpu.unsupported(dtype, tiling.hopper_tiling)
  if why is None and interpret and tiling.forward is None:
    why = "interpret mode runs the Triton forward unless forward='mosaic_gpu' is asked for"
  if why is None and not interpret and not mosaic_device.hopper_device():
    why = f"it needs a Hopper GPU, and the device is {mosaic_device.device_description()}"
  return why

def _dlogits_unsupported(dtype, dims: Dims, has_bias: bool, interpret: bool):
  """Why the Hopper dlogits kernel cannot serve the chunked backward, or None."""
  t = dims.tiling
  if jnp.dtype(dtype) != jnp.bfloat16:
    return f"it writes ds in bfloat16 for bfloat16 inputs, not {jnp.dtype(dtype)}"
  if has_bias:
    return "dbias needs ds in float32; with a bias the chunked backward forms it in XLA"
  if t.backward not in (None, "chunked"):
    return f"it serves the chunked backward, not backward={t.backward!r}"
  if dims.chunk % t.hopper_tiling.block_vocab:
    return (f"the chunk ({dims.chunk} columns) must be a multiple of block_vocab "
            f"({t.hopper_tiling.block_vocab})")
  needed = mosaic_gpu.dlogits_smem_bytes(t.hopper_tiling, jnp.dtype(dtype).itemsize)
  if needed > mosaic_device.SMEM_BYTES:
    return f"it needs {needed} bytes of shared memory, more than {mosaic_device.SMEM_BYTES}"
  if interpret and t.dlogits is None:
    return "interpret mode forms ds in XLA unless dlogits='mosaic_gpu' is asked for"
  if not interpret and not mosaic_device.hopper_device():
    return f"it needs a Hopper GPU, and the device is {mosaic_device.device_description()}"
  return None

def _with_hopper_kernel(tiling: LinearCrossEntropyTiling, field: str, portable: str,
                        why: str | None, op: str) -> LinearCrossEntropyTiling:
  """``tiling`` with its ``field`` ("forward" or "dlogits") decided: "mosaic_gpu" where
  asked for, or left to the default and ``why`` (the reason the Hopper kernel cannot
  run) is None, else ``portable``. Asking for "mosaic_gpu" where it cannot run is an
  error."""
  value = getattr(tiling, field)
  if value == "mosaic_gpu" and why is not None:
    raise ValueError(f"{op}: tiling.{field}='mosaic_gpu' cannot run: {why}")
  if value is None:
    return dataclasses.replace(tiling, **{field: portable if why else "mosaic_gpu"})
  return tiling

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
# is the backward (`_backward`); reverse mode only transposes it. Evaluating it (forward
# mode) or differentiating it again (second order) would need the logits' own
# derivatives, which these kernels never form: both raise this.
_REVERSE_ONLY = (
    "linear_cross_entropy is differentiable in reverse mode (jax.grad, jax.vjp) only: "
    "forward mode (jax.jvp, jax.jacfwd, jax.linearize) and second derivatives "
    "(jax.hessian, jvp of grad) are not supported by its fused kernels. For those, form "
    "the logits and use cross_entropy, which supports every mode: "
    "cross_entropy(jnp.dot(hidden, weight, preferred_element_type=jnp.float32), labels)")

def _tangent_kernel(res, t, *, sizes: Dims, options: Options):
  raise NotImplementedError(_REVERSE_ONLY)

def _tangent_types(res, t, *, sizes: Dims, options: Options):
  del t, sizes, options
  m = res[4]  # (R,) float32, varying over the mesh axes the inputs vary over
  return m, m

def _transpose_kernel(res, cts, *, sizes: Dims, options: Options):
  x, w, b, labels, m, log_l = res
  g, g_lse = cts
  # Rows with a label out of range (possible only inside jit) give NaN gradients.
  in_range = (labels >= 0) & (labels < sizes.V)
  g = jnp.where(in_range | (g == 0), g.astype(jnp.float32), jnp.nan)
  rows = Rows(labels, m, log_l, g, g_lse.astype(jnp.float32))
  dx, dw, db = _backward(x, w, b, rows, sizes, options)
  return (dx.astype(x.dtype), dw.astype(w.dtype)) + (() if b is None else
                                                     (db.astype(b.dtype),))

def _transpose_types(res, cts, *, sizes: Dims, options: Options):
  del cts, sizes, options
  x, w, b = res[:3]
  return (x, w) + (() if b is None else (b,))

# The weight is no row's own: under vmap the maps run once per batch element. (The
# problem's sizes go as "sizes": JAX's batching rules take an argument named dims.)
_TANGENT = LinearMap("linear_cross_entropy_tangent", kernel=_tangent_kernel, twin=None,
                     out_types=_tangent_types, no_twin=_REVERSE_ONLY,
                     fold_rows=lambda **_: False).pair(
    LinearMap("linear_cross_entropy_transpose", kernel=_transpose_kernel, twin=None,
              out_types=_transpose_types, no_twin=_REVERSE_ONLY, fold_rows=lambda **_: False))

@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _state(x, w, b, labels, dims: Dims, options: Options):
  """(loss, lse, m, log l) of each row: the losses and the residuals of the backward.
  Differentiated only at second order (`_losses_and_lse` differentiates the losses): an error."""
  m, log_l, label_logit, total = _forward(x, w, b, labels, dims, options)
  lse = m + log_l
  return _loss(lse, label_logit, total, labels, dims, options), lse, m, log_l

@_state.defjvp
def _state_jvp(dims: Dims, options: Options, primals, tangents):
  raise NotImplementedError(_REVERSE_ONLY)

@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _losses_and_lse(x, w, b, labels, dims: Dims, options: Options):
  return _state(x, w, b, labels, dims, options)[:2]

@_losses_and_lse.defjvp
def _losses_and_lse_jvp(dims: Dims, options: Options, primals, tangents):
  x, w, b, labels = primals
  loss, lse, m, log_l = _state(x, w, b, labels, dims, options)
  t = tuple(tangents[:2]) + (() if b is None else (tangents[2],))
  return (loss, lse), _TANGENT((x, w, b, labels, m, log_l), t, sizes=dims, options=options)

def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         logit_soft_cap: float | None = None, reduction: str = "mean",
                         return_lse: bool = False,
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
    tiling: optional `LinearCrossEntropyTiling`.
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
  check_labels(labels, V, ignore_index, op)
  if (hidden.dtype == jnp.float64 or hidden.size == 0 or labels.size == 0
      or pallas.xla_by_default(interpret, kernel_asked=tiling is not None)):
    return reference.linear_cross_entropy(
        hidden, weight, labels, bias=bias, ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, logit_soft_cap=logit_soft_cap,
        reduction=reduction, return_lse=return_lse)

  interpret = pallas.resolve_interpret(interpret)
  tiling = tiling or LinearCrossEntropyTiling()
  if tiling.forward != "triton":
    tiling = _with_hopper_kernel(tiling, "forward", "triton",
                                 _hopper_unsupported(hidden.dtype, tiling, interpret), op)
  flat_labels = labels.reshape(-1).astype(jnp.int32)
  dims = Dims(flat_labels.size, H, V, tiling)
  if tiling.dlogits != "xla":
    # By default the Hopper kernel where it runs: it saves XLA's float32 logits and their
    # elementwise pass, forward + backward 56.9 against 60.3 ms at H = 4096 on the H200
    # (benchmarks/results/linear_cross_entropy.md, "fused, XLA dlogits").
    tiling = _with_hopper_kernel(
        tiling, "dlogits", "xla",
        _dlogits_unsupported(hidden.dtype, dims, bias is not None, interpret), op)
    dims = dataclasses.replace(dims, tiling=tiling)
  options = Options(float(label_smoothing), float(z_loss),
                     None if logit_soft_cap is None else float(logit_soft_cap),
                     bias is not None, interpret)
  hidden, weight, bias, flat_labels = pallas.vary_together(hidden, weight, bias, flat_labels)
  loss, lse = _losses_and_lse(hidden.reshape(-1, H), weight, bias, flat_labels, dims, options)
  loss = reduce_losses(jnp.where(flat_labels != ignore_index, loss, 0.0), labels, None,
                       ignore_index, reduction)
  return (loss, lse.reshape(labels.shape)) if return_lse else loss
