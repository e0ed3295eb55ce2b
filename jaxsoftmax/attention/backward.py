"""FlashAttention backward (FlashAttention-2, Algorithm 2) as two Pallas kernels.

Nothing of size T x S is stored: probabilities are recomputed from the saved lse,

    P = exp(S - lse);  dV = Pᵀ dO;  dP = dO Vᵀ;  dS = P ∘ (dP - delta)
    dQ = dS K · scale;  dK = dSᵀ Q · scale;     delta = rowsum(dO ∘ O)

with dS multiplied by 1 - tanh²(s / cap) under a soft cap. A row that had no allowed key
has lse = -inf: it is read as +inf, so its P, and all its gradients, are exactly 0.

- dK/dV kernel: one program per (key block, batch row, K/V head); it keeps its K, V tiles
  and accumulators and walks the query blocks that can see them, for every query head of
  its group (GQA: dK, dV are summed over the group in registers).
- dQ kernel: one program per (query block, batch row, query head), walking the key
  blocks in the forward's three ranges (element masks on the boundary blocks only).
FLOPs: 2.5x the forward's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax import _backend
from jaxsoftmax._backend import pl
from jaxsoftmax.attention.forward import scores
from jaxsoftmax.attention.masks import (MaskSpec, element_mask, key_block_ranges,
                                        query_block_ranges)
from jaxsoftmax.attention.tiling import Aux, BlockSizes, Dims, load_scalar
from jaxsoftmax.rowwise import exp_for


def _probabilities(s, lse, exp):
  """P = exp(s - lse), exactly 0 for rows whose lse is -inf (no allowed key)."""
  return exp(s - jnp.where(lse == -jnp.inf, jnp.inf, lse)[:, None])


def _score_grad(p, dp, delta, tanh):
  ds = p * (dp - delta[:, None])
  return ds if tanh is None else ds * (1 - tanh * tanh)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, dims: Dims,
                 spec: MaskSpec, blocks: BlockSizes, aux: Aux, scale: float,
                 softcap: float | None, exp):
  aux_refs, (dk_ref, dv_ref) = refs[:aux.count], refs[aux.count:]
  q_len_ref, kv_len_ref, q_seg_ref, kv_seg_ref = aux.unpack(aux_refs)
  bq, bk = blocks.block_q_bwd, blocks.block_k_bwd
  group = dims.N // dims.K
  k0 = pl.program_id(0) * bk
  k_idx = k0 + jnp.arange(bk, dtype=jnp.int32)
  kv_ok = k_idx < dims.S if dims.S % bk else None
  h_ok = jnp.arange(dims.H_pad, dtype=jnp.int32) < dims.H if dims.H_pad != dims.H else None
  kv_mask = dims.tile_mask(kv_ok, h_ok, bk)
  k = _backend.load(k_ref, mask=kv_mask, other=0)
  v = _backend.load(v_ref, mask=kv_mask, other=0)
  q_length, kv_length = load_scalar(q_len_ref), load_scalar(kv_len_ref)
  k_seg = None if kv_seg_ref is None else _backend.load(kv_seg_ref, mask=kv_ok, other=-2)
  lo, hi = query_block_ranges(spec, k0, bq, bk, kv_length, q_length, pl.cdiv(dims.T, bq))

  def step(i, carry, g):
    dk, dv = carry
    q0 = i * bq
    q_idx = q0 + jnp.arange(bq, dtype=jnp.int32)
    q_ok = q_idx < dims.T if dims.T % bq else None
    q_mask = dims.tile_mask(q_ok, h_ok, bq)
    rows = pl.ds(q0, bq)
    q = _backend.load(q_ref.at[rows, g, :], mask=q_mask, other=0)
    do = _backend.load(do_ref.at[rows, g, :], mask=q_mask, other=0)
    lse = _backend.load(lse_ref.at[g, rows], mask=q_ok, other=-jnp.inf)
    delta = _backend.load(delta_ref.at[g, rows], mask=q_ok, other=0)
    s, tanh = scores(q, k, scale=scale, softcap=softcap)
    q_seg = None
    if q_seg_ref is not None:
      q_seg = _backend.load(q_seg_ref.at[rows], mask=q_idx < dims.T, other=-1)
    allowed = element_mask(spec, q_idx[:, None], k_idx[None, :], kv_length, q_seg, k_seg)
    p = jnp.where(allowed, _probabilities(s, lse, exp), 0.0)
    dv = dv + _backend.dot(p.astype(do.dtype), do, trans_a=True)
    dp = _backend.dot(do, v, trans_b=True)
    ds = _score_grad(p, dp, delta, tanh)
    dk = dk + _backend.dot(ds.astype(q.dtype), q, trans_a=True)
    return dk, dv

  def head(g, carry):
    return lax.fori_loop(lo, hi, functools.partial(step, g=g), carry)

  zeros = jnp.zeros((bk, dims.H_pad), jnp.float32)
  dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
  _backend.store(dk_ref, (dk * scale).astype(dk_ref.dtype), mask=kv_mask)
  _backend.store(dv_ref, dv.astype(dv_ref.dtype), mask=kv_mask)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, dims: Dims,
               spec: MaskSpec, blocks: BlockSizes, aux: Aux, scale: float,
               softcap: float | None, exp):
  aux_refs, (dq_ref,) = refs[:aux.count], refs[aux.count:]
  q_len_ref, kv_len_ref, q_seg_ref, kv_seg_ref = aux.unpack(aux_refs)
  bq, bk = blocks.block_q_bwd, blocks.block_k_bwd
  q0 = pl.program_id(0) * bq
  q_idx = q0 + jnp.arange(bq, dtype=jnp.int32)
  q_ok = q_idx < dims.T if dims.T % bq else None
  h_ok = jnp.arange(dims.H_pad, dtype=jnp.int32) < dims.H if dims.H_pad != dims.H else None
  q_mask = dims.tile_mask(q_ok, h_ok, bq)
  q = _backend.load(q_ref, mask=q_mask, other=0)
  do = _backend.load(do_ref, mask=q_mask, other=0)
  lse = _backend.load(lse_ref, mask=q_ok, other=-jnp.inf)
  delta = _backend.load(delta_ref, mask=q_ok, other=0)
  q_length, kv_length = load_scalar(q_len_ref), load_scalar(kv_len_ref)
  q_seg = None if q_seg_ref is None else _backend.load(q_seg_ref, mask=q_ok, other=-1)

  def step(j, dq, *, masked: bool):
    k0 = j * bk
    k_idx = k0 + jnp.arange(bk, dtype=jnp.int32)
    kv_ok = (k_idx < dims.S) if masked and dims.S % bk else None
    kv_mask = dims.tile_mask(kv_ok, h_ok, bk)
    k = _backend.load(k_ref.at[pl.ds(k0, bk), :], mask=kv_mask, other=0)
    v = _backend.load(v_ref.at[pl.ds(k0, bk), :], mask=kv_mask, other=0)
    s, tanh = scores(q, k, scale=scale, softcap=softcap)
    p = _probabilities(s, lse, exp)
    if masked:
      k_seg = None
      if kv_seg_ref is not None:
        k_seg = _backend.load(kv_seg_ref.at[pl.ds(k0, bk)], mask=k_idx < dims.S, other=-2)
      allowed = element_mask(spec, q_idx[:, None], k_idx[None, :], kv_length, q_seg, k_seg)
      p = jnp.where(allowed, p, 0.0)
    dp = _backend.dot(do, v, trans_b=True)
    ds = _score_grad(p, dp, delta, tanh)
    return dq + _backend.dot(ds.astype(k.dtype), k)

  lo, full_lo, full_hi, hi = key_block_ranges(spec, q0, bq, bk, kv_length, q_length)
  dq = jnp.zeros((bq, dims.H_pad), jnp.float32)
  dq = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), dq)
  dq = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), dq)
  dq = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), dq)
  _backend.store(dq_ref, (dq * scale).astype(dq_ref.dtype), mask=q_mask)


def backward(q, k, v, o, lse, do, aux_arrays, *, spec: MaskSpec, blocks: BlockSizes,
             scale: float, softcap: float | None, interpret: bool):
  """(dq, dk, dv) for the forward's inputs, its output o and its lse (B, N, T)."""
  dims = Dims.of(q, k)
  aux, aux_arrays = Aux.of(aux_arrays)
  bq, bk = blocks.block_q_bwd, blocks.block_k_bwd
  group = dims.N // dims.K
  exp = exp_for(interpret)
  # delta = rowsum(dO ∘ O): one fused XLA pass over O and dO.
  delta = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
  n_q_blocks, n_k_blocks = pl.cdiv(dims.T, bq), pl.cdiv(dims.S, bk)
  q_rows, kv_rows = n_q_blocks * bq, n_k_blocks * bk
  statics = dict(dims=dims, spec=spec, blocks=blocks, aux=aux, scale=scale,
                 softcap=softcap, exp=exp)

  # dK/dV: grid (key block, batch, K/V head); all query heads of the group, all queries.
  q_group = pl.BlockSpec((None, q_rows, group, dims.H_pad), lambda j, b, h: (b, 0, h, 0))
  kv_tile = pl.BlockSpec((None, bk, None, dims.H_pad), lambda j, b, h: (b, j, h, 0))
  stat_group = pl.BlockSpec((None, group, q_rows), lambda j, b, h: (b, h, 0))
  dk, dv = _backend.pallas_call(
      functools.partial(_dkdv_kernel, **statics), name="attention_backward_dkdv",
      grid=(n_k_blocks, dims.B, dims.K),
      in_specs=[q_group, kv_tile, kv_tile, q_group, stat_group, stat_group,
                *aux.specs(q_rows=q_rows, q_index=lambda j, b, h: (b, 0), kv_rows=bk,
                           kv_index=lambda j, b, h: (b, j), batch_index=lambda j, b, h: b)],
      out_specs=[kv_tile, kv_tile],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      num_warps=blocks.num_warps_bwd, num_stages=blocks.num_stages, interpret=interpret,
  )(q, k, v, do, lse, delta, *aux_arrays)

  # dQ: grid (query block, batch, query head), walking the key blocks.
  q_tile = pl.BlockSpec((None, bq, None, dims.H_pad), lambda i, b, n: (b, i, n, 0))
  kv_all = pl.BlockSpec((None, kv_rows, None, dims.H_pad),
                        lambda i, b, n: (b, 0, n // group, 0))
  stat_tile = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
  dq = _backend.pallas_call(
      functools.partial(_dq_kernel, **statics), name="attention_backward_dq",
      grid=(n_q_blocks, dims.B, dims.N),
      in_specs=[q_tile, kv_all, kv_all, q_tile, stat_tile, stat_tile,
                *aux.specs(q_rows=bq, q_index=lambda i, b, n: (b, i), kv_rows=kv_rows,
                           kv_index=lambda i, b, n: (b, 0), batch_index=lambda i, b, n: b)],
      out_specs=q_tile,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      num_warps=blocks.num_warps_bwd, num_stages=blocks.num_stages, interpret=interpret,
  )(q, k, v, do, lse, delta, *aux_arrays)
  return dq, dk, dv
