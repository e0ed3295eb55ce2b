"""Context-parallel attention: the sequence sharded over a mesh axis, exactly.

Inside `jax.shard_map`, each of the P devices of ``axis_name`` holds a shard of the
queries and of the keys/values along the sequence (layout B T N H). Two strategies:

- ``"ring"`` (Liu et al., Ring Attention, 2023): K and V, stacked into one buffer (with
  their segment ids), travel around the ring by `lax.ppermute`. At step s device d holds
  the block of device d - s and runs the attention kernels of its queries against it;
  the partial (o, lse) merge in float32 through `merge_attention_states`. The transfer
  for step s + 1 is issued before step s's kernels, so that XLA runs the two at once.
  The backward walks the ring again: each step gives dQ (kept) and dK, dV of the
  visiting block, float32 accumulators that travel on with it, stacked, and are home
  after P steps (the last hop in the inputs' dtype: the sums are complete then).
- ``"all_gather"`` (Llama 3's context parallelism): K and V gathered once, one kernel
  call per query chunk, the key gradients summed back to their owners by
  `lax.psum_scatter`.

Layouts: ``"contiguous"`` (device d holds tokens [d·C, (d+1)·C)) and ``"zigzag"`` (the
sequence cut into 2P chunks, device d holding chunks d and 2P-1-d: under a causal mask
every device then does the same work; `zigzag_permute` puts tokens in that order).

Every kernel call sees a static mask. A causal mask or a window between a query block and
a key block at offset Δ (the difference of their first positions) is the band
i - (left - Δ) <= j <= i + (right + Δ) in the blocks' own indices (`_band`). Δ depends on
the device index, so a `lax.switch` on it picks among the static variants (two per ring
step, one per device when gathered), and blocks that the masks leave empty are never
computed. The causal zigzag ring needs no switch after its first step: every device then
runs two unmasked chunk-by-chunk tiles, and only where they sit depends on the device
(`_zigzag_tiles`). That keeps conditionals out of its program: on two GPUs its transfers
ran under no kernel while its steps were conditionals (64k tokens, causal forward: 2 of
1027 us of NCCL time under a kernel, benchmarks/results/tuning/ring_attention_lhs.md;
575 of 1063 without them, ring_attention_switchfree.md).

The backward runs the backward that pairs with each step's forward
(`api.select_backward`: the Hopper one on an H200, else Triton's) on the global row
statistics (the merged lse, as the kernels' m with log2 l = 0) and the global delta, and
returns float32 partial gradients, summed in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxsoftmax.attention import reference
from jaxsoftmax._core import pallas
from jaxsoftmax._core.backends import check_implementation
from jaxsoftmax.attention import api, logits
from jaxsoftmax.attention.call import AuxArrays, Call
from jaxsoftmax.attention.masks import MaskSpec, check_window
from jaxsoftmax._core.linear_map import LinearMap
from jaxsoftmax._core.state import merge_attention_states
from jaxsoftmax.attention.context_parallel.zigzag import zigzag_permute, zigzag_unpermute

__all__ = ["ring_attention", "context_parallel_attention"]

LAYOUTS = ("contiguous", "zigzag")
STRATEGIES = ("ring", "all_gather")


def _band(T: int, S: int, offset: int, is_causal: bool, window, has_segments: bool):
  """The static mask of T queries at positions p + i against S keys at p - offset + j
  (i, j from 0), or None when it allows no pair: the causal mask and the window
  (left, right) are the band i - left' <= j <= i + right' with left' = left - offset and
  right' = right + offset (right capped at 0 when causal); a side that no (i, j) reaches
  is dropped."""
  left, right = window if window is not None else (None, None)
  if is_causal:
    right = 0 if right is None else min(right, 0)
  left = None if left is None else left - offset
  right = None if right is None else right + offset
  if (right is not None and T - 1 + right < 0) or (left is not None and -left > S - 1):
    return None
  if right is not None and right >= S - 1:
    right = None
  if left is not None and left >= T - 1:
    left = None
  return MaskSpec(q_len=T, kv_len=S, window_left=left, window_right=right,
                  has_segments=has_segments)


@dataclasses.dataclass(frozen=True)
class _Piece:
  """One kernel call: the local query rows [q0, q0 + T) against keys [k0, k0 + S) of the
  key/value block at hand, under ``spec``."""

  q0: int
  T: int
  k0: int
  S: int
  spec: MaskSpec


@dataclasses.dataclass(frozen=True)
class _RingPlan:
  """Everything static about one context-parallel call."""

  axis_name: Any
  shards: int
  layout: str
  strategy: str
  is_causal: bool
  window: tuple[int, int] | None
  has_segments: bool
  scale: float
  softcap: float | None
  implementation: str | None
  block_sizes: Any
  interpret: bool
  deterministic: bool
  B: int
  T: int  # local queries
  S: int  # local keys
  N: int
  K: int
  H: int
  dtype: str

  def call(self, piece: _Piece) -> Call:
    return Call(B=self.B, T=piece.T, S=piece.S, N=self.N, K=self.K, H=self.H,
                dtype=self.dtype, spec=piece.spec, scale=self.scale, softcap=self.softcap,
                block_sizes=self.block_sizes, interpret=self.interpret,
                deterministic=self.deterministic, packed=self.has_segments)

  def _whole(self, S: int, offset: int) -> list[_Piece]:
    spec = _band(self.T, S, offset, self.is_causal, self.window, self.has_segments)
    return [] if spec is None else [_Piece(0, self.T, 0, S, spec)]

  def ring_step(self, s: int) -> tuple[list[_Piece], list[_Piece]]:
    """The pieces of ring step s, for devices d >= s (index 0) and for d < s (index 1,
    which hold the block of device d - s + P). The causal zigzag steps s > 0 are not
    pieces of static place but `_zigzag_tiles` (`tiled_step`)."""
    if s == 0 or (self.layout == "zigzag" and not self.is_causal):
      # Its own block (in zigzag order too, the local order is the global one), or no
      # mask to shift.
      own = self._whole(self.S, 0)
      return own, own
    assert not self.tiled_step(s), "causal zigzag steps are _zigzag_tiles"
    return self._whole(self.S, s * self.T), self._whole(self.S, (s - self.shards) * self.T)

  def tiled_step(self, s: int) -> bool:
    """Whether ring step s runs `_zigzag_tiles` (the causal zigzag steps after the
    first) rather than the pieces of `ring_step`."""
    return s > 0 and self.layout == "zigzag" and self.is_causal

  def gathered(self) -> list[list[_Piece]]:
    """The pieces of each device d against all keys in their natural order."""
    S, P = self.S * self.shards, self.shards
    if self.layout == "contiguous":
      return [self._whole(S, d * self.T) for d in range(P)]
    if not self.is_causal:
      return [[_Piece(0, self.T, 0, S, MaskSpec(self.T, S, has_segments=self.has_segments))]]
    c = self.T // 2  # zigzag: the local chunks d and 2P-1-d, each under its own offset
    return [[_Piece(q0, c, 0, S, _band(c, S, chunk * c, True, None, self.has_segments))
             for q0, chunk in ((0, d), (c, 2 * P - 1 - d))] for d in range(P)]


def _block_forward(plan: _RingPlan, piece: _Piece, q, k, v, q_seg, kv_seg):
  """(o in float32 (B, T, N, H), lse (B, T, N)) of one kernel call."""
  call = plan.call(piece)
  if plan.implementation == "xla":  # the reference, in float32
    f32 = lambda x: x.astype(jnp.float32)
    return api.reference_attention(f32(q), f32(k), f32(v),
                                   AuxArrays(q_segments=q_seg, kv_segments=kv_seg), call)
  backend = api.select_backend(plan.implementation, call)
  o, m, log2_l, *o32 = backend.fwd(q, k, v, AuxArrays(q_segments=q_seg, kv_segments=kv_seg),
                                   call, float32_output=q.dtype != jnp.float32)
  o = (o32[0] if o32 else o).astype(jnp.float32)
  lse = logits.lse(m, log2_l, scale=plan.scale, softcap=plan.softcap)
  return o, jnp.transpose(lse, (0, 2, 1))


def _block_backward(plan: _RingPlan, piece: _Piece, q, k, v, q_seg, kv_seg, delta, lse, do):
  """float32 (dq, dk, dv) of one kernel call, from the global lse and
  delta = rowsum(dO ∘ O) of the global output, both (B, T, N)."""
  call = plan.call(piece)
  if plan.implementation == "xla":
    return _xla_block_backward(call, q, k, v, q_seg, kv_seg, delta, lse, do)
  # The kernels take the lse as (m, log2 l) with lse = m · factor + log(l).
  factor = logits.Logits(plan.scale, plan.softcap, fused=False).factor
  m = jnp.transpose(lse, (0, 2, 1)) / factor
  # The backward that pairs with the step's forward (`api.select_backward`).
  backward = api.select_backward(call, api.select_backend(plan.implementation, call).NAME)
  return backward.bwd(q, k, v, None, m, jnp.zeros_like(m), do,
                      AuxArrays(q_segments=q_seg, kv_segments=kv_seg), call,
                      grad_dtype=jnp.float32, delta=jnp.transpose(delta, (0, 2, 1)))


def _xla_block_backward(call: Call, q, k, v, q_seg, kv_seg, delta, lse, do):
  """`_block_backward` in jnp, float32 (FlashAttention-2's backward, docs/math.md): from
  the global lse and delta, P = exp(logits - lse), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - delta)
  (times 1 - tanh² under a soft cap), dQ = dS K · scale, dK = dSᵀ Q · scale."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  q, do = (x.astype(jnp.float32).reshape(B, T, K, N // K, H) for x in (q, do))
  k, v = k.astype(jnp.float32), v.astype(jnp.float32)
  rows = lambda x: x.reshape(B, T, K, N // K).transpose(0, 2, 3, 1)[..., None]  # B K G T 1
  x = jnp.einsum("btkgh,bskh->bkgts", q, k, precision=lax.Precision.HIGHEST)
  tanh = None
  if call.softcap is None:
    x = x * call.scale
  else:
    tanh = jnp.tanh(x * (call.scale / call.softcap))
    x = call.softcap * tanh
  spec = call.spec
  allowed = reference.attention_mask(T, S, is_causal=spec.is_causal,
                                     local_window_size=api.spec_window(spec),
                                     q_segments=q_seg, kv_segments=kv_seg, batch=B)
  finite = jnp.isfinite(rows(lse))  # a row with no allowed key has lse -inf: P = 0
  p = jnp.where(allowed[:, :, None] & finite, jnp.exp(x - jnp.where(finite, rows(lse), 0)),
                0.0)
  dv = jnp.einsum("bkgts,btkgh->bskh", p, do, precision=lax.Precision.HIGHEST)
  ds = p * (jnp.einsum("btkgh,bskh->bkgts", do, v, precision=lax.Precision.HIGHEST)
            - rows(delta))
  if tanh is not None:
    ds = ds * (1 - tanh * tanh)
  dq = jnp.einsum("bkgts,bskh->btkgh", ds, k, precision=lax.Precision.HIGHEST) * call.scale
  dk = jnp.einsum("bkgts,btkgh->bskh", ds, q, precision=lax.Precision.HIGHEST) * call.scale
  return dq.reshape(B, T, N, H), dk, dv


def _query_rows(x, piece: _Piece):
  return x if x is None else x[:, piece.q0:piece.q0 + piece.T]


def _keys(x, piece: _Piece):
  return x if x is None else x[:, piece.k0:piece.k0 + piece.S]


def _padded(x, start: int, length: int, fill=0.0):
  """x, rows [start, start + x.shape[1]) of ``length`` along axis 1, padded with fill.
  (Padding, not `.at[].set`: jaxlib 0.11.2's CPU compiler crashes on the latter inside
  a multi-device shard_map.)"""
  widths = [(0, 0)] * x.ndim
  widths[1] = (start, length - start - x.shape[1])
  return jnp.pad(x, widths, constant_values=fill)


def _forward_pieces(plan: _RingPlan, pieces, q, q_seg, k, v, kv_seg):
  """The local queries' (o, lse) against one key/value block: the pieces cover disjoint
  query rows; rows no piece covers have o = 0 and lse = -inf."""
  B, T, N, H = q.shape
  o = jnp.zeros((B, T, N, H), jnp.float32)
  lse = jnp.full((B, T, N), -jnp.inf, jnp.float32)
  for piece in pieces:
    o_p, lse_p = _block_forward(plan, piece, _query_rows(q, piece), _keys(k, piece),
                                _keys(v, piece), _query_rows(q_seg, piece), _keys(kv_seg, piece))
    o = o + _padded(o_p, piece.q0, T)
    lse = jnp.maximum(lse, _padded(lse_p, piece.q0, T, -jnp.inf))
  return o, lse


def _backward_pieces(plan: _RingPlan, pieces, q, q_seg, k, v, kv_seg, delta, lse, do):
  """float32 (dq, dk, dv) of the local queries against one key/value block."""
  dq = jnp.zeros(q.shape, jnp.float32)
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  for piece in pieces:
    dq_p, dk_p, dv_p = _block_backward(
        plan, piece, _query_rows(q, piece), _keys(k, piece), _keys(v, piece),
        _query_rows(q_seg, piece), _keys(kv_seg, piece), _query_rows(delta, piece),
        _query_rows(lse, piece), _query_rows(do, piece))
    dq = dq + _padded(dq_p, piece.q0, q.shape[1])
    dk = dk + _padded(dk_p, piece.k0, k.shape[1])
    dv = dv + _padded(dv_p, piece.k0, v.shape[1])
  return dq, dk, dv


def _choose(index, variants: tuple, run, *operands):
  """run(variants[index], *operands), index traced; one branch when all variants are the
  same. Every branch's results vary over the operands' mesh axes (a branch with no
  kernel to run returns constants, which vary over none), as `lax.switch` wants."""
  if all(v == variants[0] for v in variants):
    return run(variants[0], *operands)
  axes = pallas.varying_axes(index, operands)
  branch = lambda v: lambda *ops: pallas.vary_over(run(v, *ops), axes)
  return lax.switch(index, [branch(v) for v in variants], *operands)


def _zigzag_tiles(plan: _RingPlan, later):
  """(the tiles' `_Piece`, their (query chunk start, key chunk start) pairs): the two
  tiles of a causal zigzag ring step s > 0, of chunk length c = T/2, all unmasked. The
  local chunks are (d, 2P-1-d), the block's (e, 2P-1-e) with e = d - s mod P; ``later``
  (traced) is e > d.
  e < d: both local chunks see chunk e whole, chunk 2P-1-e not at all;
  e > d: chunk 2P-1-d sees both of the block's chunks whole, chunk d neither."""
  c = plan.T // 2
  shifted = jnp.where(later, c, 0)
  piece = _Piece(0, c, 0, c, MaskSpec(c, c, has_segments=plan.has_segments))
  return piece, ((shifted, 0), (c, shifted))


def _chunk(x, start, c: int, axis: int = 1):
  return x if x is None else lax.dynamic_slice_in_dim(x, start, c, axis=axis)


def _add_chunk(acc, x, start, axis: int = 1):
  """acc with x added to its rows [start, start + x.shape[axis]) along ``axis``."""
  rows = lax.dynamic_slice_in_dim(acc, start, x.shape[axis], axis=axis)
  return lax.dynamic_update_slice_in_dim(acc, rows + x, start, axis=axis)


def _zigzag_forward_step(plan: _RingPlan, later, q, q_seg, k, v, kv_seg, o, lse):
  """(o, lse) of the local queries, the step's two tiles merged in."""
  piece, tiles = _zigzag_tiles(plan, later)
  c = piece.T
  for q0, k0 in tiles:
    o_t, lse_t = _block_forward(plan, piece, _chunk(q, q0, c), _chunk(k, k0, c),
                                _chunk(v, k0, c), _chunk(q_seg, q0, c),
                                _chunk(kv_seg, k0, c))
    o_rows, lse_rows = merge_attention_states(_chunk(o, q0, c), _chunk(lse, q0, c), o_t,
                                              lse_t)
    o = lax.dynamic_update_slice_in_dim(o, o_rows, q0, axis=1)
    lse = lax.dynamic_update_slice_in_dim(lse, lse_rows, q0, axis=1)
  return o, lse


def _zigzag_backward_step(plan: _RingPlan, later, q, q_seg, k, v, kv_seg, delta, lse, do,
                          dq, dkv):
  """(dq, dkv) with the step's two tiles' gradients added (dkv: the visiting block's
  accumulators, dK and dV stacked)."""
  piece, tiles = _zigzag_tiles(plan, later)
  c = piece.T
  for q0, k0 in tiles:
    rows = functools.partial(_chunk, start=q0, c=c)
    keys = functools.partial(_chunk, start=k0, c=c)
    dq_t, dk_t, dv_t = _block_backward(plan, piece, rows(q), keys(k), keys(v), rows(q_seg),
                                       keys(kv_seg), rows(delta), rows(lse), rows(do))
    dq = _add_chunk(dq, dq_t, q0)
    dkv = _add_chunk(dkv, jnp.stack([dk_t, dv_t]), k0, axis=2)
  return dq, dkv


def _next_device(plan: _RingPlan, x):
  """x sent one step around the ring (device d to d + 1)."""
  P = plan.shards
  return lax.ppermute(x, plan.axis_name, [(i, (i + 1) % P) for i in range(P)])


def _gather(plan: _RingPlan, x, axis: int = 1):
  """x's shards of every device along the sequence (``axis``), in natural order."""
  x = lax.all_gather(x, plan.axis_name, axis=axis, tiled=True)
  return x if plan.layout == "contiguous" else zigzag_unpermute(x, plan.shards, axis)


# K and V (and their gradients) travel as one stacked buffer, one transfer per hop: XLA
# keeps one collective permute in flight at a time, and V's beside K's ran synchronously,
# under no kernel, on two GPUs (a 488 us NCCL kernel on the compute stream before the
# first attention kernel: benchmarks/results/tuning/
# ring_attention_switchfree_T65536_causal_fwd_timeline.json).
def _forward(plan: _RingPlan, q, k, v, q_seg, kv_seg):
  """(o, lse) of the local queries in float32, o (B, T, N, H) and lse (B, T, N)."""
  d = lax.axis_index(plan.axis_name)
  if plan.strategy == "all_gather":
    k, v = _gather(plan, jnp.stack([k, v]), axis=2)
    kv_seg = None if kv_seg is None else _gather(plan, kv_seg)
    return _choose(d, tuple(plan.gathered()),
                   functools.partial(_forward_pieces, plan), q, q_seg, k, v, kv_seg)
  block = (jnp.stack([k, v]), kv_seg)
  o = lse = None
  for s in range(plan.shards):
    if s + 1 < plan.shards:  # issued before this step's kernels, to run beside them
      next_block = _next_device(plan, block)
    kv, seg = block
    k_s, v_s = (k, v) if s == 0 else (kv[0], kv[1])
    if plan.tiled_step(s):
      o, lse = _zigzag_forward_step(plan, d < s, q, q_seg, k_s, v_s, seg, o, lse)
    else:
      o_s, lse_s = _choose((d < s).astype(jnp.int32), plan.ring_step(s),
                           functools.partial(_forward_pieces, plan), q, q_seg, k_s, v_s,
                           seg)
      o, lse = (o_s, lse_s) if o is None else merge_attention_states(o, lse, o_s, lse_s)
    if s + 1 < plan.shards:
      block = next_block
  return o, lse


def _backward(plan: _RingPlan, q, k, v, q_seg, kv_seg, o, lse, do):
  """(dq, dk, dv) of the local shards: dq in float32, dk and dv in float32 when gathered
  and in k's dtype from the ring (their last hop carries the finished sums)."""
  d = lax.axis_index(plan.axis_name)
  run = functools.partial(_backward_pieces, plan)
  # delta of the local queries once, for every step and piece: (B, T, N), as lse.
  delta = jnp.transpose(logits.row_delta(o, do), (0, 2, 1))
  if plan.strategy == "all_gather":
    k_all, v_all = _gather(plan, jnp.stack([k, v]), axis=2)
    kv_seg_all = None if kv_seg is None else _gather(plan, kv_seg)
    dq, dk, dv = _choose(d, tuple(plan.gathered()), run, q, q_seg, k_all, v_all,
                         kv_seg_all, delta, lse, do)
    dkv = jnp.stack([dk, dv])
    if plan.layout == "zigzag":
      dkv = zigzag_permute(dkv, plan.shards, axis=2)
    dk, dv = lax.psum_scatter(dkv, plan.axis_name, scatter_dimension=2, tiled=True)
    return dq, dk, dv
  block = (jnp.stack([k, v]), kv_seg)
  dq = jnp.zeros(q.shape, jnp.float32)
  dkv = jnp.zeros((2, *k.shape), jnp.float32)  # the visiting block's accumulators
  for s in range(plan.shards):
    if s + 1 < plan.shards:
      next_block = _next_device(plan, block)
    kv, seg = block
    k_s, v_s = (k, v) if s == 0 else (kv[0], kv[1])
    if plan.tiled_step(s):
      dq, dkv = _zigzag_backward_step(plan, d < s, q, q_seg, k_s, v_s, seg, delta, lse, do,
                                      dq, dkv)
    else:
      dq_s, dk_s, dv_s = _choose((d < s).astype(jnp.int32), plan.ring_step(s), run, q,
                                 q_seg, k_s, v_s, seg, delta, lse, do)
      dq, dkv = dq + dq_s, dkv + jnp.stack([dk_s, dv_s])
    if s + 1 == plan.shards:  # complete: the last hop home carries them in k's dtype
      dkv = dkv.astype(k.dtype)
    # The accumulators go on with their block; after the P-th hop they are home.
    dkv = _next_device(plan, dkv)
    if s + 1 < plan.shards:
      block = next_block
  return dq, dkv[0], dkv[1]


# --- derivatives: reverse mode on the kernels, a clear error otherwise ------------------
# The output's tangent is a linear map of (dq, dk, dv) whose transpose is `_backward`;
# reverse mode only transposes it. Forward mode and second order would need the
# distributed attention's own derivatives, which nothing here forms: both raise this.
_REVERSE_ONLY = (
    "ring_attention is differentiable in reverse mode (jax.grad, jax.vjp) only: forward "
    "mode (jax.jvp, jax.jacfwd, jax.linearize) and second derivatives (jax.hessian, jvp "
    "of grad) are not supported across devices. For those, gather the sequence and use "
    "dot_product_attention, which supports every mode")


def _tangent_kernel(res, t, *, plan: _RingPlan):
  raise NotImplementedError(_REVERSE_ONLY)


def _tangent_types(res, t, *, plan: _RingPlan):
  del t, plan
  return res[:1]  # q's type


def _transpose_kernel(res, cts, *, plan: _RingPlan):
  q, k, v, q_seg, kv_seg, o, lse = res
  dq, dk, dv = _backward(plan, q, k, v, q_seg, kv_seg, o, lse, cts[0])
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _transpose_types(res, cts, *, plan: _RingPlan):
  del cts, plan
  return res[:3]


_TANGENT = LinearMap("ring_attention_tangent", kernel=_tangent_kernel, twin=None,
                     out_types=_tangent_types, no_twin=_REVERSE_ONLY).pair(
    LinearMap("ring_attention_transpose", kernel=_transpose_kernel, twin=None,
              out_types=_transpose_types, no_twin=_REVERSE_ONLY))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _state(plan: _RingPlan, q, k, v, q_seg, kv_seg, sinks):
  """(o in q's dtype, o and lse in float32): the output and the backward's residuals.
  ``sinks`` (None or (B, N)) join the merged result as one more part with o = 0
  (docs/math.md, "Attention sinks"), so the residuals are those of the whole softmax.
  Differentiated only at second order (`_context_parallel` differentiates the output):
  an error."""
  o, lse = _forward(plan, q, k, v, q_seg, kv_seg)
  if sinks is not None:
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, :], lse.shape)
    o, lse = merge_attention_states(o, lse, jnp.zeros_like(o), sink)
  return o.astype(q.dtype), o, lse


@_state.defjvp
def _state_jvp(plan: _RingPlan, primals, tangents):
  raise NotImplementedError(_REVERSE_ONLY)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _context_parallel(plan: _RingPlan, q, k, v, q_seg, kv_seg, sinks):
  return _state(plan, q, k, v, q_seg, kv_seg, sinks)[0]


@_context_parallel.defjvp
def _context_parallel_jvp(plan: _RingPlan, primals, tangents):
  q, k, v, q_seg, kv_seg, sinks = primals
  out, o, lse = _state(plan, q, k, v, q_seg, kv_seg, sinks)
  do, = _TANGENT((q, k, v, q_seg, kv_seg, o, lse), tuple(tangents[:3]), plan=plan)
  if sinks is not None:  # the sinks' own term; its transpose sums dsinks over the rows
    p_sink = logits.sink_probability_from_lse(lse, sinks)
    do = do + logits.sink_tangent(o, p_sink, tangents[5]).astype(do.dtype)
  return out, do


def _shards(axis_name, op: str) -> int:
  try:
    return lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(f"{op}: axis_name {axis_name!r} is not an axis of the enclosing "
                     "shard_map (call it inside jax.shard_map over a mesh with that "
                     "axis, or use context_parallel_attention)") from e


def ring_attention(query, key, value, *, axis_name, is_causal: bool = False, scale=None,
                   layout: str = "contiguous", strategy: str = "ring", segment_ids=None,
                   logits_soft_cap=None, local_window_size=None, implementation=None,
                   block_sizes=None, interpret: bool | None = None,
                   deterministic: bool | None = None, sinks=None):
  """Attention over a sequence sharded on the mesh axis ``axis_name``, inside
  `jax.shard_map`: this device's shard of the output. Differentiable.

  Args:
    query: this device's queries, (B, T, N, H): the sequence axis T is sharded.
    key, value: this device's keys and values, (B, S, K, H), K dividing N. With a
      causal mask, a window or the zigzag layout, S == T (self-attention).
    axis_name: the mesh axis the sequence is sharded over (P devices, in ring order).
    is_causal: key j visible to query i when j <= i, in global positions.
    scale: logits scale, 1/sqrt(H) by default.
    layout: "contiguous" (device d holds tokens [d·T, (d+1)·T)) or "zigzag" (device d
      holds chunks d and 2P-1-d of 2P, see `zigzag_permute`: balanced under a causal
      mask). The zigzag layout takes no window.
    strategy: "ring" (K/V passed around the ring, overlapped with the kernels) or
      "all_gather" (K/V gathered once).
    segment_ids: this device's segment ids, (B, T) (or a (query, key) pair): a query sees
      only keys of its segment (packed sequences).
    logits_soft_cap, local_window_size: as `jaxsoftmax.dot_product_attention` (the
      window in global positions).
    implementation: the forward's kernel backend, as `dot_product_attention`; the
      backward is the one that pairs with it (see above). "xla": every block in jnp,
      float32 (the default off a GPU).
    block_sizes: tiles for the forward's backend, as `dot_product_attention`.
    interpret: run the kernels in Pallas interpret mode (the Triton backend).
    deterministic: as `dot_product_attention`: gradients bit-identical from run to run
      (no atomic adds in the Hopper backward).
    sinks: optional attention sinks, (N,) floating, one logit per (local) query head, as
      `dot_product_attention`: they join the merged result of the ring, and their
      gradient is summed over the devices.

  Returns:
    This device's shard of the output, shaped and typed like ``query``.
  """
  op = "ring_attention"
  query, key, value = (jnp.asarray(a) for a in (query, key, value))
  api._check_inputs(query, key, value, op)
  if query.dtype == jnp.float64:
    raise TypeError(f"{op}: float64 inputs have no kernel; use float32, bfloat16 or "
                    "float16")
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  if value.shape[3] != H:
    raise ValueError(f"{op}: value {value.shape} must have the head dim of key "
                     f"{key.shape}; dot_product_attention takes different ones")
  if layout not in LAYOUTS:
    raise ValueError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")
  if strategy not in STRATEGIES:
    raise ValueError(f"{op}: strategy must be one of {STRATEGIES}, got {strategy!r}")
  check_implementation(op, implementation, api.IMPLEMENTATIONS)
  if implementation is None and pallas.xla_by_default(
      interpret, kernel_asked=block_sizes is not None):
    implementation = "xla"  # off a GPU: the blocks in jnp (`_xla_block_backward`)
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"{op}: logits_soft_cap must be > 0, got {logits_soft_cap!r}")
  window = check_window(local_window_size, op)
  if (is_causal or window is not None or layout == "zigzag") and S != T:
    raise ValueError(f"{op}: a causal mask, a window or the zigzag layout need query and "
                     f"key shards of one length, got T={T} and S={S}")
  if layout == "zigzag":
    if T % 2:
      raise ValueError(f"{op}: layout='zigzag' needs an even shard length (two chunks "
                       f"per device), got T={T}")
    if window is not None:
      raise ValueError(f"{op}: local_window_size needs layout='contiguous'")
  q_seg, kv_seg = api._segments(segment_ids, B, T, S, op)
  plan = _RingPlan(axis_name, _shards(axis_name, op), layout, strategy, bool(is_causal), window,
               q_seg is not None, float(1 / np.sqrt(H) if scale is None else scale),
               logits_soft_cap, implementation, block_sizes,
               pallas.resolve_interpret(interpret),
               pallas.resolve_deterministic(deterministic), B, T, S, N, K, H,
               jnp.dtype(query.dtype).name)
  sinks = api._check_sinks(sinks, query, op)
  query, key, value, q_seg, kv_seg, sinks = pallas.vary_together(query, key, value, q_seg,
                                                                 kv_seg, sinks)
  return _context_parallel(plan, query, key, value, q_seg, kv_seg, sinks)


def context_parallel_attention(query, key, value, *, mesh, axis_name,
                               layout: str = "contiguous", batch_axis=None, head_axis=None,
                               segment_ids=None, sinks=None, **kwargs):
  """`ring_attention` for global arrays: shards the sequence axis of query, key and value
  (B, T, N, H) over the mesh axis ``axis_name`` (and, optionally, the batch over
  ``batch_axis`` and the heads over ``head_axis``) with `jax.shard_map`, and returns the
  global output. Inputs and output are in natural order: with ``layout="zigzag"`` they
  are permuted into the zigzag order and back here, on each tensor's whole sequence (one
  gather and one reshard each way); a training loop saves that by keeping its tokens
  zigzag-permuted (`zigzag_permute`) and calling `ring_attention` in its own
  `shard_map`. ``segment_ids`` is (B, T) or a (query, key) pair of global arrays;
  ``sinks`` (N,) is sharded with the heads; other keywords go to `ring_attention`."""
  op = "context_parallel_attention"
  for name, axis in (("axis_name", axis_name), ("batch_axis", batch_axis),
                     ("head_axis", head_axis)):
    if axis is not None and axis not in mesh.axis_names:
      raise ValueError(f"{op}: {name} {axis!r} is not an axis of the mesh "
                       f"{tuple(mesh.axis_names)}")
  query, key, value = (jnp.asarray(a) for a in (query, key, value))
  P = mesh.shape[axis_name]
  per = 2 * P if layout == "zigzag" else P
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(f"{op}: {name} must have rank 4 (B, T, N, H), got shape {x.shape}")
    if x.shape[1] % per:
      raise ValueError(f"{op}: the sequence axis (1) of {name} {x.shape} must be a "
                       f"multiple of {per} ({P} devices on {axis_name!r}"
                       f"{', two chunks each (zigzag)' if layout == 'zigzag' else ''})")
  pair = isinstance(segment_ids, (tuple, list))
  segments = None if segment_ids is None else (
      tuple(jnp.asarray(s) for s in segment_ids) if pair else jnp.asarray(segment_ids))
  # One jitted program per configuration, so that repeated calls reuse its compilation.
  options = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                         for k, v in kwargs.items()))
  run = _sharded_program(mesh, axis_name, layout, batch_axis, head_axis,
                         None if segments is None else pair, sinks is not None, options)
  return run(query, key, value, *([] if segments is None else [segments]),
             *([] if sinks is None else [jnp.asarray(sinks)]))


@functools.cache
def _sharded_program(mesh, axis_name, layout: str, batch_axis, head_axis,
                     segment_pair: bool | None, with_sinks: bool, options: tuple):
  """The jitted global-array program of `context_parallel_attention` for one
  configuration (``segment_pair``: None without segment ids, else whether they are a
  (query, key) pair; ``with_sinks``: the last input is the sinks)."""
  P = mesh.shape[axis_name]
  tokens = PartitionSpec(batch_axis, axis_name, head_axis, None)
  ids = PartitionSpec(batch_axis, axis_name)

  def local(query, key, value, *rest):
    segments = rest[0] if segment_pair is not None else None
    sinks = rest[-1] if with_sinks else None
    return ring_attention(query, key, value, axis_name=axis_name, layout=layout,
                          segment_ids=segments, sinks=sinks, **dict(options))

  in_specs = (tokens, tokens, tokens)
  if segment_pair is not None:
    in_specs = (*in_specs, (ids, ids) if segment_pair else ids)
  if with_sinks:  # one per query head: sharded as the heads are
    in_specs = (*in_specs, PartitionSpec(head_axis))
  # check_vma=False: Pallas' interpreter fails under check_vma (docs/numerics.md); the
  # kernels themselves declare their outputs' varying mesh axes.
  sharded = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=tokens,
                          check_vma=False)

  def place(x, spec):
    return jax.reshard(x, NamedSharding(mesh, spec))

  def whole_sequence(spec):  # the spec with the sequence axis (1) not sharded
    return PartitionSpec(spec[0], None, *spec[2:])

  def each(fn, args):
    return jax.tree.map(fn, args, in_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))

  @jax.jit
  def run(*args):  # inputs placed anywhere are resharded to the specs
    if layout == "zigzag":  # reordered on whole sequences: tokens move between shards
      args = each(lambda x, spec: zigzag_permute(place(x, whole_sequence(spec)), P)
                  if len(spec) > 1 else x, args)  # (the sinks have no sequence axis)
    out = sharded(*each(place, args))
    if layout == "zigzag":
      out = place(zigzag_unpermute(place(out, whole_sequence(tokens)), P), tokens)
    return out

  return run
