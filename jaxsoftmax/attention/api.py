"""`dot_product_attention`: jax.nn.dot_product_attention's signature on FlashAttention
kernels, differentiable in every mode: a custom JVP whose tangent map is a kernel
(forward mode) and, transposed, the backward kernels, from (q, k, v, o) and the
log-sum-exp (as its parts m and log2 l, see `triton.forward`), nothing of size T x S
(below, "derivatives").

Layout B T N H (or T N H, unbatched); K/V heads K dividing N (GQA, MQA). Beyond jax.nn:
``logits_soft_cap``, ``segment_ids`` for packed sequences, and ``block_sizes``. A query
row with no allowed key gets output 0, lse -inf and zero gradients (jax.nn averages the
values instead). ``bias``, ``mask`` and ``alibi_slopes`` run in the Triton kernels, read
by tiles (`triton.tiling.ScoreTerms`); dbias comes from the dQ kernel when the bias is
differentiated (the tangent's symbolic zero says when it is not). A key-padding mask
(one row of keys per batch row) runs in the Hopper kernels too, as segment ids
(`_key_mask_as_segments`). A mask without a head axis that is a padded batch's (each
row's first queries and keys, with or without the causal mask) runs as query and key
lengths instead, on either backend, chosen at run time by a ``lax.switch``
(`_mask_as_lengths`; under ``vmap`` over the mask every branch runs).

Backends: each kernel backend (a folder beside this module, an `AttentionBackend`)
declares what it can run (``unsupported(call)`` gives the reason it cannot) and runs the
forward (``fwd``). `REGISTRY` lists them fastest first and dispatches
(`jaxsoftmax._core.backends.Registry`): ``implementation=None`` takes the first that can
run the call. All forwards save the same residuals: a backend's own backward
differentiates its forward where it can (``backward_unsupported``), and the Triton
backward everything else (`select_backward`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jaxsoftmax.attention import reference
from jaxsoftmax._core import pallas
from jaxsoftmax.attention import logits, mosaic_gpu, triton
from jaxsoftmax.attention.decode import backend as decode_backend
from jaxsoftmax._core.backends import Registry, check_implementation
from jaxsoftmax.attention.call import AttentionBackend, AuxArrays, BackwardBackend, Call
from jaxsoftmax.attention.masks import MaskSpec, check_window
from jaxsoftmax.attention.mosaic_gpu import HopperBlockSizes
from jaxsoftmax.attention.triton import BlockSizes
from jaxsoftmax._core.linear_map import LinearMap

__all__ = ["dot_product_attention", "attention_kernels", "select_backend", "BACKENDS",
           "BlockSizes", "HopperBlockSizes"]

# Kernel backends in order of preference (fastest first, where each can run a call).
REGISTRY: Registry[AttentionBackend] = Registry(
    "dot_product_attention", (decode_backend, mosaic_gpu, triton),
    otherwise="implementation='xla' takes the reference path")
BACKENDS = REGISTRY.backends
IMPLEMENTATIONS = REGISTRY.implementations


def _forward(q, k, v, aux, sinks, call: Call, backend: str, *, for_backward: bool):
  """(o, lse, and with ``for_backward`` the residuals (o for delta, m, log2 l)). The
  backward's delta = rowsum(dO ∘ O) wants O before rounding (see `triton.forward`).
  ``sinks``: None, or (B, N) logits that every backend's forward joins (`logits.join_sink`):
  its o and statistics include them, so the backward is the plain one."""
  float32_output = for_backward and q.dtype != jnp.float32
  o, m, log2_l, *o32 = REGISTRY[backend].fwd(q, k, v, aux, call,
                                             float32_output=float32_output, sinks=sinks)
  lse = logits.lse(m, log2_l, scale=call.scale, softcap=call.softcap)
  return (o, lse, o32[0] if o32 else o, m, log2_l) if for_backward else (o, lse)


# --- derivatives (`linear_map`) ------------------------------------------------------
# The output's tangent is a linear map of (dq, dk, dv) with the residuals (q, k, v, the
# aux arrays, and the forward's o, m, log2 l). Reverse mode transposes it into the
# backward kernels, from the residuals a custom VJP would save; forward mode (jax.jvp,
# jax.linearize, jacfwd) evaluates it: the Triton tangent kernel (`triton.tangent`), from
# the same residuals. Second order (a Hessian-vector product) differentiates the maps in
# their residuals, through their twin: the reference attention's own derivatives in XLA,
# whose memory is O(T·S). The public lse has no derivative (a stop_gradient, as in
# jax.nn).


def spec_window(spec) -> tuple[int, int] | None:
  """The (left, right) window of a `MaskSpec` as jax.nn spells it (a side without a
  bound reaches every key), or None."""
  if spec.window_left is None and spec.window_right is None:
    return None
  far = spec.q_len + spec.kv_len
  return (far if spec.window_left is None else spec.window_left,
          far if spec.window_right is None else spec.window_right)


def reference_attention(q, k, v, aux: AuxArrays, call: Call, sinks=None, bias=None):
  """(out, lse (B, T, N) float32) of the reference attention for ``call``, its masks
  from `call.spec` and the arrays in ``aux`` (``bias`` in place of aux's, if given)."""
  spec = call.spec
  bias = aux.bias if bias is None else bias
  mask = None if aux.mask is None else aux.mask != 0
  return reference.dot_product_attention(
      q, k, v, bias, mask, scale=call.scale, is_causal=spec.is_causal,
      query_seq_lengths=aux.q_lengths, key_value_seq_lengths=aux.kv_lengths,
      local_window_size=spec_window(spec), logits_soft_cap=call.softcap,
      q_segments=aux.q_segments, kv_segments=aux.kv_segments, sinks=sinks,
      alibi_slopes=aux.alibi_slopes)


# The maps' residuals: (q, k, v, the aux arrays (`AuxArrays`, the bias among them), o
# for delta, m, log2 l, sinks (B, N) or None); the map of (dq, dk, dv), and of dbias
# where the bias is differentiated (``bias_grad``), holds the sinks fixed (their own
# tangent is `logits.sink_tangent`).
_N_AUX = len(AuxArrays._fields)


def _reference_of(res, call: Call, bias_grad: bool):
  """(the reference output as a function of (q, k, v[, bias]), those inputs) from the
  residuals."""
  q, k, v, *aux = res[:3 + _N_AUX]
  aux, sinks = AuxArrays(*aux), res[-1]
  inputs = (q, k, v, aux.bias) if bias_grad else (q, k, v)
  return (lambda q, k, v, *bias: reference_attention(q, k, v, aux, call, sinks, *bias)[0],
          inputs)


def _tangent_kernel(res, t, *, call: Call, backend: str, bias_grad: bool):
  """Forward mode: the Triton tangent kernel, which takes any forward's residuals (its
  rows past their length zeroed, as `_rows_past_length_zeroed` says why)."""
  del backend, bias_grad
  q, k, v, *aux, o, m, log2_l, _ = res
  aux = AuxArrays(*aux)
  return (_rows_past_length_zeroed(triton.jvp(q, k, v, o, m, log2_l, t, aux, call), aux),)


def _tangent_twin(res, t, *, call: Call, backend: str, bias_grad: bool):
  del backend
  fn, inputs = _reference_of(res, call, bias_grad)
  return (jax.jvp(fn, inputs, t)[1],)


def _rows_past_length_zeroed(x, aux: AuxArrays):
  """``x`` (B, T, N, ·) with the query rows at or past their length zeroed. Those rows'
  output is 0, and nothing of theirs may reach the derivatives; but the kernels walk
  whole blocks of rows, so the rows past a length inside a block take part: with sinks
  their lse is the sink's, finite, so P = exp(s - lse) is not 0 there (dq 325 off), and
  a NaN in their q (padding data) made every dK and dV of its batch row and K/V head NaN.
  A q and dO of 0 there make their P finite and their dS and P·dO 0, so they add
  nothing to dQ, dK, dV, dbias or dsinks; tangents there are zeroed after the kernel."""
  if aux.q_lengths is None:
    return x
  valid = jnp.arange(x.shape[1])[None, :] < aux.q_lengths[:, None]
  return jnp.where(valid[:, :, None, None], x, jnp.zeros((), x.dtype))


def _transpose_kernel(res, cts, *, call: Call, backend: str, bias_grad: bool):
  q, k, v, *aux, o, m, log2_l, _ = res
  aux = AuxArrays(*aux)
  q, do = (_rows_past_length_zeroed(x, aux) for x in (q, cts[0]))
  if bias_grad:  # the Triton backward: the one that runs a bias (`triton.unsupported`)
    return triton.bwd(q, k, v, o, m, log2_l, do, aux, call, with_dbias=True)
  return select_backward(call, backend).bwd(q, k, v, o, m, log2_l, do, aux, call)


def _transpose_twin(res, cts, *, call: Call, backend: str, bias_grad: bool):
  del backend
  fn, inputs = _reference_of(res, call, bias_grad)
  return jax.vjp(fn, *inputs)[1](cts[0])


def _folds_rows(*, call: Call, backend: str, bias_grad: bool) -> bool:
  """Whether vmap may fold its axis into the batch: not with a mask, bias or slopes,
  whose leading axes are not the batch's (`LinearMap.fold_rows`)."""
  del backend, bias_grad
  return not call.score_terms


_TANGENT = LinearMap("attention_tangent", kernel=_tangent_kernel, twin=_tangent_twin,
                     fold_rows=_folds_rows).pair(
    LinearMap("attention_transpose", kernel=_transpose_kernel, twin=_transpose_twin,
              fold_rows=_folds_rows))


def _dense(tangent, primal):
  """A tangent as an array: zeros for JAX's symbolic zero (an input not differentiated)."""
  if isinstance(tangent, SymbolicZero):
    return jnp.zeros(primal.shape, primal.dtype)
  return tangent


def _output_tangent(primals, tangents, state, call: Call, backend: str):
  """The output's tangent for (dq, dk, dv), the bias's where it is differentiated, and
  the sinks', from the forward's ``state``. The bias's tangent takes part only when
  given: its transpose, dbias, is the dQ kernel's extra output."""
  q, k, v, aux, sinks = primals
  _, _, o_delta, m, log2_l = state
  t = tuple(_dense(t, x) for t, x in zip(tangents[:3], (q, k, v)))
  bias_grad = aux.bias is not None and not isinstance(tangents[3].bias, SymbolicZero)
  if bias_grad:
    t = t + (tangents[3].bias,)
  do, = _TANGENT((q, k, v, *aux, o_delta, m, log2_l, sinks), t, call=call,
                 backend=backend, bias_grad=bias_grad)
  if sinks is not None and not isinstance(tangents[4], SymbolicZero):
    p_sink = logits.sink_probability(m, log2_l, sinks, scale=call.scale,
                                     softcap=call.softcap)
    do = do + logits.sink_tangent(o_delta, p_sink, tangents[4]).astype(do.dtype)
  return do


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6))
def _state(q, k, v, aux, sinks, call: Call, backend: str):
  """(o, lse, o for delta, m, log2 l): the forward with the residuals of its derivatives.
  Its own derivatives are needed at second order only, where the maps' twins recompute
  from (q, k, v) and read none of the residuals; the sinks' term reads (m, log2 l)
  (`logits.sink_probability`), so with sinks their lse moves as the reference's does."""
  return _forward(q, k, v, aux, sinks, call, backend, for_backward=True)


def _lse_tangent(primals, tangents, call: Call):
  """The tangent of each row's lse (B, N, T) float32 in natural units, sinks included,
  from the reference (second order only, which runs the twins, O(T·S) already); 0 on
  rows whose lse is not finite."""
  q, k, v, aux, sinks = primals
  args = (q, k, v, sinks)
  dots = tuple(_dense(t, x) for t, x in zip((*tangents[:3], tangents[4]), args))
  if aux.bias is not None and not isinstance(tangents[3].bias, SymbolicZero):
    args, dots = args + (aux.bias,), dots + (tangents[3].bias,)
  lse = lambda q, k, v, sinks, *bias: reference_attention(q, k, v, aux, call, sinks,
                                                          *bias)[1]
  lse, lse_dot = jax.jvp(lse, args, dots)
  return jnp.transpose(jnp.where(jnp.isfinite(lse), lse_dot, 0.0), (0, 2, 1))


@functools.partial(_state.defjvp, symbolic_zeros=True)
def _state_jvp(call: Call, backend: str, primals, tangents):
  state = _state(*primals, call, backend)
  _, lse, o_delta, m, log2_l = state
  do = _output_tangent(primals, tangents, state, call, backend)
  log2_l_dot = jnp.zeros_like(log2_l)
  if primals[4] is not None:  # lse = m · factor + log2 l / log2(e): m held, l moves
    log2_l_dot = _lse_tangent(primals, tangents, call) * logits.LOG2E
  return state, (do, jnp.zeros_like(lse), do.astype(o_delta.dtype), jnp.zeros_like(m),
                 log2_l_dot.astype(log2_l.dtype))


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6))
def _attention(q, k, v, aux, sinks, call: Call, backend: str):
  return _forward(q, k, v, aux, sinks, call, backend, for_backward=False)


@functools.partial(_attention.defjvp, symbolic_zeros=True)
def _attention_jvp(call: Call, backend: str, primals, tangents):
  state = _state(*primals, call, backend)
  o, lse = state[:2]
  return (o, lse), (_output_tangent(primals, tangents, state, call, backend),
                    jnp.zeros_like(lse))


_attention_jit = jax.jit(_attention, static_argnums=(5, 6))


def select_backward(call: Call, backend: str) -> BackwardBackend:
  """The backward for a forward that ``backend`` ran: the backend's own where it has one
  that can differentiate the call, else the Triton backward, which takes any forward's
  residuals (o, m, log2 l) and is deterministic."""
  own = REGISTRY[backend]
  return own if own.backward_unsupported(call) is None else triton


def select_backend(implementation: str | None, call: Call) -> AttentionBackend:
  """The kernel backend that runs ``call``: the named one, or the first of `BACKENDS`
  that can; a ValueError says why when none can (`Registry.select`)."""
  return REGISTRY.select(implementation, call)


def _static_float(x, name: str) -> float | None:
  """``x`` (None, a number, or a concrete scalar array) as a Python float: the kernels
  compile it in. A traced value gets a TypeError that names the argument."""
  if x is None:
    return None
  if isinstance(x, jax.core.Tracer):
    raise TypeError(f"dot_product_attention: {name} must be a concrete number (the "
                    f"kernels compile it in), got a traced value {x.aval}; pass it as a "
                    "Python float, or close over it rather than pass it through jax.jit")
  if jnp.ndim(x) != 0:
    raise ValueError(f"dot_product_attention: {name} must be a scalar, got shape "
                     f"{jnp.shape(x)}")
  return float(x)


def _lengths(lengths, batch: int, name: str, size: int):
  """``lengths`` as int32, clipped to [0, size] (the axis they count): a length past the
  axis means all of it, as in jax.nn, and the kernels' block arithmetic on lengths near
  2^31 overflowed int32 (a key length of 2^31 - 1 gave a row of zeros)."""
  if lengths is None:
    return None
  lengths = jnp.asarray(lengths)
  if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"dot_product_attention: {name} must be an integer array of shape "
                     f"({batch},), got {lengths.dtype} {lengths.shape}")
  return jnp.clip(lengths, 0, size).astype(jnp.int32)


def _segments(segment_ids, B: int, T: int, S: int, op: str = "dot_product_attention"):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    q_seg, kv_seg = (jnp.asarray(s) for s in segment_ids)
  else:
    q_seg = kv_seg = jnp.asarray(segment_ids)
  if q_seg.shape != (B, T) or kv_seg.shape != (B, S) or not (
      jnp.issubdtype(q_seg.dtype, jnp.integer) and jnp.issubdtype(kv_seg.dtype, jnp.integer)):
    raise ValueError(
        f"{op}: segment_ids must be integer arrays of shape (B, T) for the queries and "
        f"(B, S) for the keys (one array when T == S); got {q_seg.dtype} {q_seg.shape} "
        f"and {kv_seg.dtype} {kv_seg.shape} for B={B}, T={T}, S={S}")
  return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


def _check_inputs(query, key, value, op: str = "dot_product_attention"):
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(f"{op}: {name} must have rank 4 (B, T, N, H) or 3 "
                       f"(T, N, H), got shape {x.shape}")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64):
      raise TypeError(f"{op}: {name} must be float32, bfloat16, float16 "
                      f"(or float64 on the reference path), got {x.dtype}")
  if not query.dtype == key.dtype == value.dtype:
    raise TypeError(f"{op}: query, key and value must share a dtype, got "
                    f"{query.dtype}, {key.dtype}, {value.dtype}")
  B, _, N, H = query.shape
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(f"{op}: key {key.shape} and value {value.shape} must agree in "
                     "(B, S, K); their head dims may differ (key H, value Hv)")
  if key.shape[0] != B or key.shape[3] != H:
    raise ValueError(f"{op}: key {key.shape} must match query "
                     f"{query.shape} in batch and head dim")
  if N % key.shape[2]:
    raise ValueError(f"{op}: the {N} query heads must be a multiple of the "
                     f"{key.shape[2]} key/value heads")


def _check_broadcasts(name: str, x, shape: tuple[int, ...]):
  """A ValueError naming ``x`` unless it is None or broadcasts to ``shape`` (B, N, T, S)."""
  if x is None:
    return
  x_shape = jnp.shape(x)
  try:
    fits = jnp.broadcast_shapes(x_shape, shape) == shape
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(f"dot_product_attention: {name} of shape {x_shape} must broadcast to "
                     f"(B, N, T, S) = {shape}")


def _rank4(x):
  """``x`` (broadcastable to (B, N, T, S)) with its leading 1s made explicit."""
  x = jnp.asarray(x)
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _check_alibi(slopes, N: int):
  """None, or the ALiBi slopes (N,) as float32 constants (no gradient, as FlashAttention
  and cuDNN take them)."""
  slopes = logits.check_per_head(slopes, N, "alibi_slopes", "slope",
                                 "dot_product_attention")
  return None if slopes is None else jax.lax.stop_gradient(slopes.astype(jnp.float32))


def _check_sinks(sinks, query, op: str = "dot_product_attention"):
  """None, or the sinks (N,) broadcast over the batch, (B, N): the derivatives' maps
  take every array batch first (`LinearMap`)."""
  B, _, N, _ = query.shape
  sinks = logits.check_per_head(sinks, N, "sinks", "logit", op)
  return None if sinks is None else jnp.broadcast_to(sinks, (B, N))


class _Plan(NamedTuple):
  """A checked attention call: the (batched) inputs, their aux arrays, and the kernel
  backend with its `Call`, or backend None for the reference path."""

  query: Any
  key: Any
  value: Any
  unbatched: bool
  aux: AuxArrays
  scale: float
  window: tuple[int, int] | None
  call: Call | None
  backend: AttentionBackend | None
  as_lengths: _MaskAsLengths | None = None


class _LengthsForm(NamedTuple):
  """A mask run as lengths (`_MaskAsLengths`), with the causal mask where ``causal``."""

  causal: bool
  call: Call
  backend: AttentionBackend


class _MaskAsLengths(NamedTuple):
  """The other ways to run a mask without a head axis: as the query and key lengths it
  implies, alone or with the causal mask (`_mask_as_lengths`); `_form_index` picks the
  one that gives the mask's attention, if any, at run time."""

  mask: Any  # bool, (B or 1, 1, T or 1, S)
  lengths: tuple  # the mask's own (query lengths or None, key lengths), each (B,)
  aux: AuxArrays  # the call's arrays, the mask replaced by the lengths
  forms: tuple[_LengthsForm, ...]


def _plan(query, key, value, bias, mask, *, scale, is_causal, query_seq_lengths,
          key_value_seq_lengths, local_window_size, implementation, logits_soft_cap,
          segment_ids, block_sizes, interpret, deterministic, alibi_slopes=None) -> _Plan:
  """Checks a `dot_product_attention` call and picks what runs it."""
  query, key, value = (jnp.asarray(a) for a in (query, key, value))
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  _check_inputs(query, key, value)
  B, T, N, H = query.shape
  S = key.shape[1]
  check_implementation("dot_product_attention", implementation, IMPLEMENTATIONS)
  logits_soft_cap = _static_float(logits_soft_cap, "logits_soft_cap")
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"dot_product_attention: logits_soft_cap must be > 0, got "
                     f"{logits_soft_cap!r}")
  if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
    raise TypeError(f"dot_product_attention: mask must be boolean (True: attend), got "
                    f"{jnp.asarray(mask).dtype}")
  if bias is not None and not jnp.issubdtype(jnp.asarray(bias).dtype, jnp.floating):
    raise TypeError(f"dot_product_attention: bias must be floating, got "
                    f"{jnp.asarray(bias).dtype}")
  for name, x in (("bias", bias), ("mask", mask)):
    _check_broadcasts(name, x, (B, query.shape[2], T, S))
  alibi_slopes = _check_alibi(alibi_slopes, N)
  if block_sizes is not None and not isinstance(block_sizes, (BlockSizes, HopperBlockSizes)):
    raise TypeError("dot_product_attention: block_sizes must be a BlockSizes or a "
                    f"HopperBlockSizes, got {block_sizes!r}")
  window = check_window(local_window_size, "dot_product_attention")
  q_len = _lengths(query_seq_lengths, B, "query_seq_lengths", T)
  kv_len = _lengths(key_value_seq_lengths, B, "key_value_seq_lengths", S)
  q_seg, kv_seg = _segments(segment_ids, B, T, S)
  scale = float(1 / np.sqrt(H)) if scale is None else _static_float(scale, "scale")
  # The kernels read a mask and a bias as rank-4 arrays whose axes are 1 or full; the
  # mask as int8 (a boolean ref is not a Triton load).
  aux = AuxArrays(q_len, kv_len, q_seg, kv_seg,
                  mask=None if mask is None else _rank4(mask).astype(jnp.int8),
                  bias=None if bias is None else _rank4(bias), alibi_slopes=alibi_slopes)

  reference_path = query.dtype == jnp.float64 or query.size == 0 or key.size == 0
  # Off a GPU the default is the XLA path too (`pallas.xla_by_default`); naming a
  # kernel backend or its tiles runs the kernels there (interpreted).
  default_xla = implementation is None and pallas.xla_by_default(
      interpret, kernel_asked=block_sizes is not None)
  if reference_path and implementation not in (None, "xla"):
    raise ValueError(f"dot_product_attention: implementation={implementation!r} cannot run "
                     "this call: float64 and empty inputs take the reference path "
                     "(implementation=None or 'xla')")
  if reference_path or default_xla or implementation == "xla":
    return _Plan(query, key, value, unbatched, aux, scale, window, None, None)
  window_left, window_right = window or (None, None)

  def call_of(has_segments: bool, has_mask: bool, causal: bool = is_causal,
              packed: bool = False) -> Call:
    return Call(B=B, T=T, S=S, N=N, K=key.shape[2], H=H, Hv=value.shape[3],
                dtype=jnp.dtype(query.dtype).name,
                spec=MaskSpec(q_len=T, kv_len=S, is_causal=bool(causal),
                              window_left=window_left, window_right=window_right,
                              has_segments=has_segments, has_mask=has_mask),
                scale=scale, softcap=logits_soft_cap, block_sizes=block_sizes,
                interpret=pallas.resolve_interpret(interpret),
                deterministic=pallas.resolve_deterministic(deterministic),
                has_bias=bias is not None, has_alibi=alibi_slopes is not None,
                packed=packed)

  as_lengths = _mask_as_lengths(aux, B, is_causal, call_of, implementation)
  if _is_key_mask(aux) and implementation in (None, "mosaic_gpu"):
    call = call_of(has_segments=True, has_mask=False)
    backend = REGISTRY.select(None, call)
    if backend.NAME == "mosaic_gpu":
      return _Plan(query, key, value, unbatched, _key_mask_as_segments(aux, B, T, S),
                   scale, window, call, backend, as_lengths)
  call = call_of(has_segments=q_seg is not None, has_mask=mask is not None,
                 packed=q_seg is not None)
  return _Plan(query, key, value, unbatched, aux, scale, window, call,
               select_backend(implementation, call), as_lengths)


def _is_key_mask(aux: AuxArrays) -> bool:
  """Whether ``aux`` holds a key-padding mask (one row of keys per batch row, shape
  (B or 1, 1, 1, S)) and no segment ids."""
  return (aux.mask is not None and aux.q_segments is None
          and aux.mask.shape[1:3] == (1, 1))


def _key_mask_as_segments(aux: AuxArrays, B: int, T: int, S: int) -> AuxArrays:
  """``aux`` with its key-padding mask (`_is_key_mask`) given as segment ids instead:
  every query in segment 0, each key in 0 where attended and 1 where masked. The Hopper
  kernels run segment ids but no mask array, and so ran such a mask 2.0x as fast as the
  Triton kernels' mask array forward and 1.4x forward + backward (4x4096x16x128
  causal, `benchmarks/results/attention_features.md`, "mask keys")."""
  kv_seg = jnp.broadcast_to((aux.mask[:, 0, 0, :] == 0).astype(jnp.int32), (B, S))
  return aux._replace(mask=None, q_segments=jnp.zeros((B, T), jnp.int32),
                      kv_segments=kv_seg)


def _mask_as_lengths(aux: AuxArrays, B: int, is_causal: bool, call_of,
                     implementation) -> _MaskAsLengths | None:
  """The ways to run ``aux``'s mask as lengths, where it has no head axis and no segment
  ids come with it: the query lengths (a mask with a query axis) and key lengths it
  implies, each the count of query rows and key columns it attends to anywhere (the
  given lengths taken where smaller), alone and with the causal mask. They give the
  mask's attention where it is what a padded batch's mask is: each row's first queries
  and first keys, with or without the causal mask (Flax's ``make_attention_mask`` of two
  padding masks, with ``make_causal_mask`` or not; a tokenizer's attention mask as keys
  alone). The kernels then skip the blocks past each length and compare nothing an
  element, where the Triton kernels' mask array cost about 2x the plain call and a
  key-padding mask 1.57x, and the Hopper kernels' segment ids for one 1.37x
  (4x4096x16x128, on an H100,
  `benchmarks/results/tuning/attention_features_bias_stages_h100.md`). Under
  ``is_causal`` only the mask's entries at or below the diagonal count. Each form's
  kernels compile beside the mask's. A form that the backend named cannot run is left
  out."""
  mask = aux.mask
  if mask is None or aux.q_segments is not None or mask.shape[1] != 1:
    return None
  rows = mask != 0
  with_queries = rows.shape[2] > 1
  if is_causal and with_queries:  # what the causal mask removes does not matter
    rows = rows & _causal(rows.shape[2], rows.shape[3])
  kv_counts = jnp.broadcast_to(
      jnp.sum(jnp.any(rows, axis=2), axis=-1, dtype=jnp.int32)[:, 0], (B,))
  q_counts = None
  if with_queries:
    q_counts = jnp.broadcast_to(
        jnp.sum(jnp.any(rows, axis=3), axis=-1, dtype=jnp.int32)[:, 0], (B,))

  def smaller(given, counts):
    return counts if given is None else given if counts is None else jnp.minimum(given, counts)

  lengths_aux = aux._replace(mask=None, q_lengths=smaller(aux.q_lengths, q_counts),
                             kv_lengths=smaller(aux.kv_lengths, kv_counts))
  forms = []
  patterns = (False,) if not with_queries else (True,) if is_causal else (False, True)
  for causal in patterns:
    call = call_of(has_segments=False, has_mask=False, causal=is_causal or causal)
    try:
      forms.append(_LengthsForm(causal, call, select_backend(implementation, call)))
    except ValueError:  # the backend named cannot run it: the mask's path runs
      continue
  if not forms:
    return None
  return _MaskAsLengths(rows, (q_counts, kv_counts), lengths_aux, tuple(forms))


def _causal(T: int, S: int) -> jax.Array:
  """The causal mask j <= i, (1, 1, T, S)."""
  return (jnp.arange(S)[None, :] <= jnp.arange(T)[:, None])[None, None]


def _form_index(as_lengths: _MaskAsLengths) -> jax.Array:
  """The first of ``as_lengths.forms`` whose lengths (and causal mask) are exactly the
  mask, else len(forms): the mask's own path."""
  rows = as_lengths.mask
  q_counts, kv_counts = (None if n is None else n[:rows.shape[0], None, None, None]
                         for n in as_lengths.lengths)
  Tm, S = rows.shape[2:]
  pattern = jnp.arange(S)[None, None, None, :] < kv_counts
  if q_counts is not None:
    pattern = pattern & (jnp.arange(Tm)[None, None, :, None] < q_counts)
  index = jnp.int32(len(as_lengths.forms))
  for k in reversed(range(len(as_lengths.forms))):
    form = pattern & _causal(Tm, S) if as_lengths.forms[k].causal else pattern
    index = jnp.where(jnp.all(rows == form), k, index)
  return index


def attention_kernels(query, key, value, bias=None, mask=None, **options) -> tuple[str, str]:
  """(forward, backward): which kernels `dot_product_attention` runs for these arguments
  (the same ones, any of its keywords) on the current device: "mosaic_gpu", "triton" or
  "xla" (the reference path). Errors as `dot_product_attention` raises them. For a
  mask, these are its own path's: a padded batch's mask runs as lengths instead where
  the run-time check says so (`_mask_as_lengths`), on the backend the lengths pick."""
  planned = ("scale", "query_seq_lengths", "key_value_seq_lengths", "local_window_size",
             "implementation", "logits_soft_cap", "segment_ids", "block_sizes",
             "interpret", "deterministic", "alibi_slopes")
  unknown = set(options) - set(planned) - {"is_causal", "return_residual", "residual_dtype",
                                           "sinks"}
  if unknown:
    raise TypeError(f"attention_kernels: unexpected keywords {sorted(unknown)}; it takes "
                    "dot_product_attention's")
  plan = _plan(query, key, value, bias, mask, is_causal=options.get("is_causal", False),
               **{name: options.get(name) for name in planned})
  if plan.backend is None:
    return "xla", "xla"
  return plan.backend.NAME, select_backward(plan.call, plan.backend.NAME).NAME


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False,
                          logits_soft_cap=None, segment_ids=None,
                          block_sizes: BlockSizes | HopperBlockSizes | None = None,
                          residual_dtype=None, interpret: bool | None = None,
                          deterministic: bool | None = None, sinks=None,
                          alibi_slopes=None):
  """Scaled dot-product attention, as jax.nn.dot_product_attention.

  Args:
    query: (B, T, N, H) or (T, N, H); float32, bfloat16 or float16.
    key, value: (B, S, K, H) and (B, S, K, Hv) or unbatched, with K dividing N; the
      value head dim Hv may differ from H (as MLA's 192 / 128), and the output takes it.
    bias: optional additive logits, floating, broadcastable to (B, N, T, S), added after
      the scale and soft cap; read by tiles in the Triton kernels (never broadcast to
      T x S), differentiable (dbias summed over its broadcast axes).
    mask: optional boolean (True: attend), broadcastable to (B, N, T, S); read by tiles
      in the Triton kernels, which skip the tiles it masks entirely at either end of a
      block's walk. A key-padding mask,
      (B, 1, 1, S) or (1, 1, 1, S), runs in the Hopper kernels as segment ids where no
      ``segment_ids`` are given. A mask without a head axis that keeps each batch
      row's first queries and first keys (a padded batch's, as Flax's
      ``make_attention_mask`` makes it), with or without the causal mask, runs as
      query and key lengths instead, decided at run time.
    scale: logits scale, 1/sqrt(H) by default.
    is_causal: key j is visible to query i when j <= i (top-left aligned when T != S).
    query_seq_lengths, key_value_seq_lengths: optional (B,) int lengths.
    local_window_size: int or (left, right): query i sees keys i - left ... i + right.
    implementation: None for the fastest kernel backend that can run the call,
      "mosaic_gpu" (Hopper GPUs, 16-bit inputs) or "triton" to name one, "xla" for the
      reference path. A named backend that cannot run the call raises a ValueError
      that says why.
    return_residual: also return the log-sum-exp of the logits, (B, T, N), in the
      inputs' dtype as jax.nn (and, as there, without a gradient).
    logits_soft_cap: cap c > 0: logits become c·tanh(logits / c) before masking.
    segment_ids: (B, T) ints when T == S, or a (query (B, T), key (B, S)) pair: a query
      sees only keys of its segment (packed sequences).
    block_sizes: optional tiles for tuning: a `BlockSizes` (Triton backend) or a
      `HopperBlockSizes` (Mosaic GPU backend's forward; its backward has one tiling).
      With ``implementation=None`` the type picks the backend.
    residual_dtype: the dtype of the returned log-sum-exp; None for the inputs' dtype.
      ``jnp.float32`` keeps the kernels' float32 statistics, which merging partial
      results (across devices, `jaxsoftmax.merge_attention_states`) wants.
    interpret: run the kernels in Pallas interpret mode (see `jaxsoftmax.softmax`);
      only the Triton backend has one.
    deterministic: gradients bit-identical from run to run. The Hopper backward sums
      dQ with atomic adds, whose order varies (results agree to float32 rounding);
      True takes dQ from a separate kernel instead (above head dim 128, the same adds
      in a fixed order). None: True when XLA_FLAGS holds
      ``--xla_gpu_deterministic_ops=true`` (or ``..._exclude_nondeterministic_ops``).
    sinks: optional attention sinks, (N,) floating: one logit per query head that joins
      each of its rows' softmax without a value (gpt-oss), in the logits' units (after
      scale and soft cap). Differentiable; a row with no allowed key gives output 0 and
      lse = its sink; the returned lse includes it.
    alibi_slopes: optional (N,) ALiBi slopes: logit (i, j) of head n gains
      -slope_n · |i - j| (positions aligned at the first key, as ``is_causal``),
      computed in the Triton kernels; constants, without a gradient.

  Returns:
    The output (B, T, N, Hv), typed like ``query``, and with ``return_residual`` the lse.
  """
  plan = _plan(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
               query_seq_lengths=query_seq_lengths,
               key_value_seq_lengths=key_value_seq_lengths,
               local_window_size=local_window_size, implementation=implementation,
               logits_soft_cap=logits_soft_cap, segment_ids=segment_ids,
               block_sizes=block_sizes, interpret=interpret, deterministic=deterministic,
               alibi_slopes=alibi_slopes)
  if residual_dtype is not None and not jnp.issubdtype(residual_dtype, jnp.floating):
    raise TypeError("dot_product_attention: residual_dtype must be a floating dtype or "
                    f"None, got {residual_dtype!r}")
  query, key, value, unbatched = plan.query, plan.key, plan.value, plan.unbatched
  sinks = _check_sinks(sinks, query)
  if plan.backend is None:
    q_len, kv_len, q_seg, kv_seg = plan.aux.lengths_and_segments
    out, lse = reference.dot_product_attention(
        query, key, value, bias, mask, scale=plan.scale, is_causal=is_causal,
        query_seq_lengths=q_len, key_value_seq_lengths=kv_len, local_window_size=plan.window,
        logits_soft_cap=logits_soft_cap, q_segments=q_seg, kv_segments=kv_seg, sinks=sinks,
        alibi_slopes=plan.aux.alibi_slopes)
    lse = jax.lax.stop_gradient(lse)
  else:
    as_lengths = plan.as_lengths
    query, key, value, aux, sinks, lengths_aux = pallas.vary_together(
        query, key, value, plan.aux, sinks,
        None if as_lengths is None else as_lengths.aux)
    kernels = lambda aux, call, backend: _attention_jit(query, key, value, aux, sinks,
                                                        call, backend.NAME)
    if as_lengths is None:
      out, lse = kernels(aux, plan.call, plan.backend)
    else:  # a padded batch's mask runs as lengths, chosen at run time
      branches = [functools.partial(kernels, lengths_aux, form.call, form.backend)
                  for form in as_lengths.forms]
      out, lse = jax.lax.switch(_form_index(as_lengths),
                                [*branches, lambda: kernels(aux, plan.call, plan.backend)])
    lse = jax.lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)))  # (B, N, T) -> (B, T, N)
  lse = lse.astype(query.dtype if residual_dtype is None else residual_dtype)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out
