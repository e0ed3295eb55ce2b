"""Fused softmax cross-entropy with integer labels, as Pallas kernels, differentiable in
every mode.

A drop-in for optax.softmax_cross_entropy_with_integer_labels (which is
``reduction="none"`` here), with the options language-model training uses. Per row
of V logits x with label y, smoothing a and z-loss coefficient z, from the row state
m = max_j x_j, l = sum_j exp(x_j - m) and lse = m + log(l):

    loss = log(l) + (1 - a)·(m - x_y) + a·(m - mean_j x_j) + z·lse²

The forward streams each row once and keeps a few float32 numbers per row (m, l and, if
a > 0, sum_j (x_j - x_0), summed relative to the row's first logit so that large logits
do not round the mean away); x_y is gathered beside it, one element per row. No
probability tensor is written. The backward is one map
over the logits, from the saved (m, l), with p_j = exp(x_j - m) / l:

    dx_j = g·[(1 + 2z·lse)·p_j - (1 - a)·[j = y] - a / V] + g_lse·p_j

where g is the loss's cotangent and g_lse the cotangent of the returned lse, if any: the
transpose of the tangent map (d loss, d lse) below (a `linear_map.LinearMap`), which is
how reverse mode reaches it; forward mode evaluates the tangent map in jnp.
With optax's ``where``, (m, l) and p cover the logits it leaves in; the label's logit
counts regardless. Class axes other than the last are moved there first (a transpose).
Minimum memory traffic: forward R·V elements read, backward R·V read and R·V written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoftmax.cross_entropy import reference
from jaxsoftmax.softmax import reference as softmax_reference
from jaxsoftmax._core import pallas
from jaxsoftmax._core.inputs import check_floating
from jaxsoftmax.rows import RowOp, RowTiling, row_call
from jaxsoftmax.rows.backends import xla_path
from jaxsoftmax._core.linear_map import LinearMap
from jaxsoftmax._core.state import probabilities, safe_shift, state_lse

__all__ = ["cross_entropy"]

REDUCTIONS = ("mean", "sum", "none")


def _forward_op(label_smoothing: float) -> RowOp:
  """The row state of the logits; with label smoothing also the sum of the logits less
  the row's first (a row input), whose float32 sum stays exact beside a large mean."""
  if not label_smoothing:
    return RowOp("cross_entropy", inputs=("logits",), state_of=lambda t: t.x.logits)
  return RowOp("cross_entropy", inputs=("logits",), row_inputs=("first",),
               state_of=lambda t: t.x.logits,
               sums={"relative_sum": lambda t: t.x.logits - t.rows.first})


def _backward_op(label_smoothing: float, z_loss: float, n_classes: int) -> RowOp:
  def apply(t, stats):
    del stats  # a pure map: the row statistics come in as row inputs
    x = t.x.logits
    label, m, l, g, g_lse = t.rows.label, t.rows.m, t.rows.l, t.rows.g, t.rows.g_lse
    # (g·(1 + 2z·lse) + g_lse)·p with p = exp(x - m) / l: one row coefficient times exp.
    d = t.exp(x - m) * ((g * (1 + 2 * z_loss * (m + jnp.log(l))) + g_lse) / l)
    d = d - jnp.where(t.cols == label, g * (1 - label_smoothing), 0.0)
    if label_smoothing:
      d = d - g * (label_smoothing / n_classes)
    return d

  return RowOp("cross_entropy_bwd", inputs=("logits",),
               row_inputs=("label", "m", "l", "g", "g_lse"), apply=apply)


def _active(labels, where, ignore_index: int):
  """The rows that count: label not ignored, and some logit not masked."""
  active = labels != ignore_index
  return active if where is None else active & jnp.any(where, axis=-1)


def _row_weights(g, labels, where, ignore_index: int, n_classes: int):
  """g on the rows that count, NaN on labels out of range (only possible inside jit,
  where they cannot be checked, so the error shows rather than hides), else 0."""
  in_range = (labels >= 0) & (labels < n_classes)
  return jnp.where(_active(labels, where, ignore_index), jnp.where(in_range, g, jnp.nan), 0.0)


def _label_index(labels, n_classes: int):
  return jnp.where((labels >= 0) & (labels < n_classes), labels, 0)


def _safe_lse(m, l):
  """lse on the rows that have one, 0 on rows with nothing left (no inf · 0 = NaN)."""
  return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1)), 0.0)


# The tangent map (d loss, d lse) of d logits, from the residuals (logits, labels, m, l
# [, where]), with p = exp(x - m) / l, s = sum(p · dx) and a the smoothing:
#     d lse = s;  d loss = (1 + 2z·lse)·s - (1 - a)·dx_label - a·mean(dx)
# Its transpose is the backward kernel of the module docstring.


def _tangent_twin(res, t, *, ignore_index, label_smoothing, z_loss, interpret):
  del interpret
  logits, labels, m, l, where = res
  dx = t[0].astype(jnp.float32)
  n_classes = logits.shape[-1]
  s = jnp.sum(probabilities(logits, m, l, where) * dx, axis=-1)
  label_dx = jnp.take_along_axis(dx, _label_index(labels, n_classes)[:, None], axis=1)[:, 0]
  dloss = (1 + 2 * z_loss * _safe_lse(m, l)) * s - (1 - label_smoothing) * label_dx
  if label_smoothing:
    dloss = dloss - label_smoothing / n_classes * jnp.sum(dx, axis=-1)
  return _row_weights(dloss, labels, where, ignore_index, n_classes), s


def _transpose_kernel(res, t, *, ignore_index, label_smoothing, z_loss, interpret):
  logits, labels, m, l, where = res
  g, g_lse = t
  n_classes = logits.shape[-1]
  g = _row_weights(g, labels, where, ignore_index, n_classes)
  dlogits = row_call(_backward_op(label_smoothing, z_loss, n_classes), (logits,),
                     (labels, m, l, g, g_lse), where=where, interpret=interpret).out
  if where is not None:
    # The kernel leaves masked logits at 0, but the label's logit counts even where it
    # is masked (optax takes it regardless): its -g goes back there.
    rows = jnp.arange(labels.shape[0])
    label = _label_index(labels, n_classes)
    dlogits = dlogits.at[rows, label].add(
        jnp.where(where[rows, label], 0.0, -g * (1 - label_smoothing)).astype(dlogits.dtype))
  return (dlogits,)


def _transpose_twin(res, t, *, ignore_index, label_smoothing, z_loss, interpret):
  del interpret
  logits, labels, m, l, where = res
  g, g_lse = t
  n_classes = logits.shape[-1]
  g = _row_weights(g, labels, where, ignore_index, n_classes)
  d = probabilities(logits, m, l, where) * (g * (1 + 2 * z_loss * _safe_lse(m, l))
                                            + g_lse)[:, None]
  is_label = jnp.arange(n_classes)[None, :] == _label_index(labels, n_classes)[:, None]
  d = d - jnp.where(is_label, (g * (1 - label_smoothing))[:, None], 0.0)
  if label_smoothing:
    d = d - (g * (label_smoothing / n_classes))[:, None]
  return (d.astype(logits.dtype),)


_TANGENT = LinearMap("cross_entropy_tangent", kernel=_tangent_twin, twin=_tangent_twin).pair(
    LinearMap("cross_entropy_transpose", kernel=_transpose_kernel, twin=_transpose_twin))


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5, 6, 7))
def _state(logits, labels, where, ignore_index, label_smoothing, z_loss, tiling, interpret):
  """(loss, lse, m, l) of each row: the losses and the forward's row state. Its
  derivatives are needed only at second order; first order goes through `_losses_and_lse`."""
  n_classes = logits.shape[-1]
  first = logits[:, 0].astype(jnp.float32)
  stats = row_call(_forward_op(label_smoothing), (logits,),
                   (first,) if label_smoothing else (), where=where, tiling=tiling,
                   interpret=interpret).stats
  m, l = stats.m, stats.l
  m, lse = safe_shift(m), state_lse(m, l)
  label_logit = jnp.take_along_axis(
      logits, _label_index(labels, n_classes)[:, None], axis=1)[:, 0].astype(jnp.float32)
  # Differences from m first: lse - x_y would lose an ulp of |lse| to cancellation.
  loss = jnp.log(l) + (1 - label_smoothing) * (m - label_logit)
  if label_smoothing:
    loss = loss + label_smoothing * ((m - first) - stats.relative_sum / n_classes)
  if z_loss:
    loss = loss + z_loss * lse**2
  # An ignored row contributes nothing, nor does a row that `where` masks entirely (as
  # optax); a label out of range makes its row NaN (see `_row_weights`).
  return _row_weights(loss, labels, where, ignore_index, n_classes), lse, m, l


def _tangents(primals, dlogits, state, statics):
  logits, labels, where = primals
  ignore_index, label_smoothing, z_loss, _, interpret = statics
  _, _, m, l = state
  return _TANGENT((logits, labels, m, l, where), (dlogits,), ignore_index=ignore_index,
                  label_smoothing=label_smoothing, z_loss=z_loss, interpret=interpret)


@_state.defjvp
def _state_jvp(*args):
  *statics, primals, tangents = args
  state = _state(*primals, *statics)
  dloss, dlse = _tangents(primals, tangents[0], state, statics)
  m, l = state[2:]
  # m is a shift (any finite value works); l = sum(exp(x - m)) moves by l · d lse.
  return state, (dloss, dlse, jnp.zeros_like(m), l * dlse)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5, 6, 7))
def _losses_and_lse(logits, labels, where, ignore_index, label_smoothing, z_loss, tiling,
                    interpret):
  return _state(logits, labels, where, ignore_index, label_smoothing, z_loss, tiling,
                interpret)[:2]


@_losses_and_lse.defjvp
def _losses_and_lse_jvp(*args):
  *statics, primals, tangents = args
  state = _state(*primals, *statics)
  return state[:2], _tangents(primals, tangents[0], state, statics)


@functools.partial(jax.jit, static_argnames=(
    "ignore_index", "label_smoothing", "z_loss", "reduction", "tiling", "interpret"))
def _cross_entropy(logits, labels, where, *, ignore_index, label_smoothing, z_loss,
                   reduction, tiling, interpret):
  batch_shape, n_classes = labels.shape, logits.shape[-1]
  flat = lambda a: None if a is None else a.reshape(-1, n_classes)
  loss, lse = _losses_and_lse(flat(logits), labels.reshape(-1).astype(jnp.int32), flat(where),
                    ignore_index, label_smoothing, z_loss, tiling, interpret)
  return reduce_losses(loss, labels, where, ignore_index, reduction), lse.reshape(batch_shape)


def reduce_losses(loss, labels, where, ignore_index: int, reduction: str):
  """The per-row losses shaped like ``labels``, summed, or averaged over the rows that
  count (0 when none does)."""
  if reduction == "none":
    return loss.reshape(labels.shape)
  if reduction == "sum":
    return jnp.sum(loss)
  count = jnp.sum(_active(labels, where, ignore_index))
  return jnp.sum(loss) / jnp.maximum(count, 1).astype(jnp.float32)


def check_labels(labels, n_classes: int, ignore_index: int, op: str = "cross_entropy"):
  """Concrete labels outside [0, n_classes) that are not ``ignore_index`` raise."""
  if isinstance(labels, jax.core.Tracer):
    return  # inside jit: out-of-range labels give NaN (see `cross_entropy`)
  values = np.asarray(labels)
  bad = (values != ignore_index) & ((values < 0) | (values >= n_classes))
  if bad.any():
    raise ValueError(
        f"{op}: labels must lie in [0, {n_classes}) or equal "
        f"ignore_index={ignore_index}; {int(bad.sum())} do not, e.g. {values[bad][0]} "
        f"at index {tuple(int(i) for i in np.argwhere(bad)[0])}")


def _classes_last(logits, labels, axis, where):
  """``logits`` as (..., V) with the class axes (``axis``: an int or a tuple, in its
  order) moved last and flattened, as optax; ``where`` (the shape of the batch or of
  ``logits``, or broadcastable to it once the class axes are inserted) the same way."""
  ndim = logits.ndim
  axes = (axis,) if isinstance(axis, int) else axis
  if not (isinstance(axes, tuple) and axes and all(isinstance(a, int) for a in axes)):
    raise TypeError(f"cross_entropy: axis must be an int or a tuple of ints, got {axis!r}")
  if any(not -ndim <= a < ndim for a in axes):
    raise ValueError(f"cross_entropy: axis {axis!r} is out of range for logits of shape "
                     f"{logits.shape}")
  axes = tuple(a % ndim for a in axes)
  if len(set(axes)) != len(axes):
    raise ValueError(f"cross_entropy: axis {axis!r} repeats an axis")
  batch = tuple(a for a in range(ndim) if a not in axes)
  batch_shape = tuple(logits.shape[a] for a in batch)
  if labels.shape != batch_shape:
    raise ValueError(f"cross_entropy: labels of shape {labels.shape} must have the shape "
                     f"of logits {logits.shape} without its class axes {axes}, "
                     f"{batch_shape}")
  if where is not None:
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
      raise TypeError(f"cross_entropy: where must be a boolean array, got {where.dtype}")
    if where.ndim != ndim:  # one flag per row, as optax: the class axes are inserted
      where = jnp.expand_dims(where, axes)
    try:
      where = jnp.broadcast_to(where, logits.shape)
    except ValueError:
      raise ValueError(f"cross_entropy: where of shape {where.shape} does not broadcast "
                       f"to logits {logits.shape}") from None
  if axes != (ndim - 1,):
    order = batch + axes
    logits = jnp.transpose(logits, order).reshape(batch_shape + (-1,))
    if where is not None:
      where = jnp.transpose(where, order).reshape(batch_shape + (-1,))
  return logits, where


def cross_entropy(logits, labels, axis=-1, where=None, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0,
                  reduction: str = "mean", return_lse: bool = False,
                  tiling: RowTiling | None = None, implementation: str | None = None,
                  interpret: bool | None = None):
  """Softmax cross-entropy between ``logits`` and integer ``labels``.

  Args:
    logits: float32, bfloat16 or float16 logits (float64 takes the reference path).
    labels: integer class indices, the shape of ``logits`` without its class axes.
    axis: the class axis, or a tuple of them (a label is then a flat index into a slice
      of their shape, in the tuple's order), as optax; the last axis by default.
    where: optional boolean mask of the logits (the shape of ``logits``, or of
      ``labels`` for one flag per row), as optax: masked logits are left out of the
      normalizer (the label's logit counts regardless), and a row with no logit left
      gives a loss of 0 and a gradient of 0 and counts as ignored.
    ignore_index: label value whose rows give a loss of 0, a gradient of 0, and are left
      out of the mean (the PyTorch convention, -100 by default).
    label_smoothing: a in [0, 1]: the target is (1 - a)·onehot + a / V, as
      optax.smooth_labels; not with ``where``.
    z_loss: coefficient of lse² added to each row's loss (PaLM's z-loss).
    reduction: ``"mean"`` over the rows that count (0 if none does), ``"sum"``, or
      ``"none"`` for per-row losses of shape ``labels.shape``.
    return_lse: also return the float32 log-sum-exp of each row (differentiable).
    tiling: optional `RowTiling` for the forward kernel.
    implementation: None, "triton" or "xla"; see `jaxsoftmax.softmax`.
    interpret: run the kernels in Pallas interpret mode; see `jaxsoftmax.softmax`.

  Returns:
    The float32 loss, or ``(loss, lse)`` with ``return_lse``.

  Labels outside [0, V) that are not ``ignore_index`` raise a ValueError when they are
  concrete; inside ``jax.jit`` they cannot be checked, and their rows' loss and
  gradients are NaN so that the error is never hidden.
  """
  logits = check_floating(logits, "logits", "cross_entropy")
  labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"cross_entropy: labels must be integers, got {labels.dtype}")
  if logits.ndim < 1:
    raise ValueError(f"cross_entropy: logits must have a class axis, got shape "
                     f"{logits.shape}")
  logits, where = _classes_last(logits, labels, axis, where)
  if logits.shape[-1] == 0:
    raise ValueError(f"cross_entropy: logits must have a non-empty class axis, got "
                     f"{logits.shape[-1]} classes")
  if reduction not in REDUCTIONS:
    raise ValueError(f"cross_entropy: reduction must be one of {REDUCTIONS}, got "
                     f"{reduction!r}")
  if not 0.0 <= label_smoothing <= 1.0:
    raise ValueError(f"cross_entropy: label_smoothing must lie in [0, 1], got "
                     f"{label_smoothing!r}")
  if label_smoothing and where is not None:
    raise ValueError("cross_entropy: label_smoothing spreads the target over every class "
                     "and where masks some of them; use one or the other")
  if z_loss < 0:
    raise ValueError(f"cross_entropy: z_loss must be >= 0, got {z_loss!r}")
  check_labels(labels, logits.shape[-1], ignore_index)
  options = dict(ignore_index=int(ignore_index), label_smoothing=float(label_smoothing),
                 z_loss=float(z_loss), reduction=reduction)
  if xla_path("cross_entropy", logits, implementation=implementation, interpret=interpret,
              tiling=tiling):
    # The XLA path: the reference on float32 logits at least (float32 losses, as ours).
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    loss = reference.cross_entropy(logits, labels, where=where, **options)
    if return_lse:
      return loss, softmax_reference.logsumexp(logits, axis=-1, where=where)
    return loss
  logits, labels, where = pallas.vary_together(logits, labels, where)
  loss, lse = _cross_entropy(logits, labels, where, **options, tiling=tiling,
                             interpret=pallas.resolve_interpret(interpret))
  return (loss, lse) if return_lse else loss
