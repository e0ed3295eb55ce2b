"""FlashAttention forward (FlashAttention-2, Algorithm 1) as a Pallas kernel.

One program per (query block, batch row, query head). It keeps its query tile in
registers and walks the key/value blocks that its masks allow (`masks.key_block_ranges`),
merging each block into the online state (m, l) and the unnormalized output
acc = sum_j exp(s_j - m) v_j:

    s = q kᵀ · scale  [· softcap: cap · tanh(s / cap)]
    m' = max(m, rowmax(s));  α = exp(m - m');  p = exp(s - m')
    l' = α l + rowsum(p);    acc' = α acc + p v

At the end o = acc / l and lse = m + log(l), float32, saved for the backward pass. A row
with no allowed key has l = 0: it gets o = 0 and lse = -inf. FLOPs: 4·B·N·T·S·H, halved
(about) by causal masking since those blocks are skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax import _backend
from jaxsoftmax._backend import pl
from jaxsoftmax.attention.masks import MaskSpec, element_mask, key_block_ranges
from jaxsoftmax.attention.tiling import Aux, BlockSizes, Dims, load_scalar
from jaxsoftmax.rowwise import exp_for
from jaxsoftmax.state import safe_shift


def scores(q, k, *, scale: float, softcap: float | None):
  """s = q kᵀ · scale in float32, soft-capped; also tanh(s_raw / cap) for the backward."""
  s = _backend.dot(q, k, trans_b=True) * scale
  if softcap is None:
    return s, None
  t = jnp.tanh(s / softcap)
  return softcap * t, t


def _forward_kernel(q_ref, k_ref, v_ref, *refs, dims: Dims, spec: MaskSpec,
                    blocks: BlockSizes, aux: Aux, scale: float, softcap: float | None,
                    exp):
  aux_refs, (o_ref, lse_ref) = refs[:aux.count], refs[aux.count:]
  q_len_ref, kv_len_ref, q_seg_ref, kv_seg_ref = aux.unpack(aux_refs)
  bq, bk = blocks.block_q, blocks.block_k
  q0 = pl.program_id(0) * bq
  q_idx = q0 + jnp.arange(bq, dtype=jnp.int32)
  q_ok = q_idx < dims.T if dims.T % bq else None
  h_ok = jnp.arange(dims.H_pad, dtype=jnp.int32) < dims.H if dims.H_pad != dims.H else None
  q_tile_mask = dims.tile_mask(q_ok, h_ok, bq)
  q = _backend.load(q_ref, mask=q_tile_mask, other=0)
  q_length, kv_length = load_scalar(q_len_ref), load_scalar(kv_len_ref)
  q_seg = None if q_seg_ref is None else _backend.load(q_seg_ref, mask=q_ok, other=-1)

  def step(j, carry, *, masked: bool):
    m, l, acc = carry
    k0 = j * bk
    k_idx = k0 + jnp.arange(bk, dtype=jnp.int32)
    # Only boundary blocks can reach past S (full blocks end before it).
    kv_ok = (k_idx < dims.S) if masked and dims.S % bk else None
    kv_mask = dims.tile_mask(kv_ok, h_ok, bk)
    k = _backend.load(k_ref.at[pl.ds(k0, bk), :], mask=kv_mask, other=0)
    s, _ = scores(q, k, scale=scale, softcap=softcap)
    if masked:
      k_seg = None
      if kv_seg_ref is not None:
        k_seg = _backend.load(kv_seg_ref.at[pl.ds(k0, bk)], mask=k_idx < dims.S, other=-2)
      allowed = element_mask(spec, q_idx[:, None], k_idx[None, :], kv_length, q_seg, k_seg)
      s = jnp.where(allowed, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    shift = safe_shift(m_new)
    p = exp(s - shift[:, None])
    alpha = exp(m - shift)
    v = _backend.load(v_ref.at[pl.ds(k0, bk), :], mask=kv_mask, other=0)
    acc = acc * alpha[:, None] + _backend.dot(p.astype(v.dtype), v)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc

  lo, full_lo, full_hi, hi = key_block_ranges(spec, q0, bq, bk, kv_length, q_length)
  carry = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
           jnp.zeros((bq, dims.H_pad), jnp.float32))
  carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
  m, l, acc = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)

  some = l > 0  # rows with at least one allowed key
  if q_length is not None:
    some = some & (q_idx < q_length)
  o = jnp.where(some[:, None], acc / jnp.where(some, l, 1.0)[:, None], 0.0)
  lse = jnp.where(some, safe_shift(m) + jnp.log(jnp.where(some, l, 1.0)), -jnp.inf)
  _backend.store(o_ref, o.astype(o_ref.dtype), mask=q_tile_mask)
  _backend.store(lse_ref, lse, mask=q_ok)


def forward(q, k, v, aux_arrays, *, spec: MaskSpec, blocks: BlockSizes, scale: float,
            softcap: float | None, interpret: bool):
  """(o (B, T, N, H), lse (B, N, T) float32) for q (B, T, N, H), k and v (B, S, K, H)."""
  dims = Dims.of(q, k)
  aux, aux_arrays = Aux.of(aux_arrays)
  bq, bk = blocks.block_q, blocks.block_k
  group = dims.N // dims.K
  n_q_blocks = pl.cdiv(dims.T, bq)
  kv_rows = pl.cdiv(dims.S, bk) * bk  # a whole number of key blocks, for interpret mode
  q_spec = pl.BlockSpec((None, bq, None, dims.H_pad), lambda i, b, n: (b, i, n, 0))
  kv_spec = pl.BlockSpec((None, kv_rows, None, dims.H_pad),
                         lambda i, b, n: (b, 0, n // group, 0))
  kernel = functools.partial(_forward_kernel, dims=dims, spec=spec, blocks=blocks, aux=aux,
                             scale=scale, softcap=softcap, exp=exp_for(interpret))
  return _backend.pallas_call(
      kernel, name="attention_forward", grid=(n_q_blocks, dims.B, dims.N),
      in_specs=[q_spec, kv_spec, kv_spec,
                *aux.specs(q_rows=bq, q_index=lambda i, b, n: (b, i), kv_rows=kv_rows,
                           kv_index=lambda i, b, n: (b, 0), batch_index=lambda i, b, n: b)],
      out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((dims.B, dims.N, dims.T), jnp.float32)],
      num_warps=blocks.num_warps, num_stages=blocks.num_stages, interpret=interpret,
  )(q, k, v, *aux_arrays)
