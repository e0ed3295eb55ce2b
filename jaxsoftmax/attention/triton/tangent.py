"""Forward-mode attention: the output's tangent for the tangents of q, k, v (and of a
bias) in one flash pass, from the forward's O and row statistics (m, log2 l).

With s the logits and P = exp(s - lse) as the forward made them, a tangent ṡ of the
logits moves P by Ṗ = P ∘ (ṡ - rowsum(P ∘ ṡ)), so

    Ȯ = Ṗ V + P V̇ = (P ∘ ṡ) V + P V̇ - rowsum(P ∘ ṡ) · O,
    ṡ = scale · (q̇ kᵀ + q k̇ᵀ) · (1 - tanh²) under a soft cap, + ḃias

(docs/math.md, "Forward mode"). One program per (query block, batch row, query head)
walks the key blocks the forward walked, recomputing P from the saved statistics as the
dQ kernel does, and keeps the row sums r = rowsum(P ∘ ṡ) and acc = (P ∘ ṡ) V + P V̇ in
float32; at the end Ȯ = acc - r · O. Five tile products per block (S, q̇ kᵀ, q k̇ᵀ and the
two with V and V̇): about 1.25x the forward's FLOPs, nothing of size T x S. The sinks'
own tangent joins after it (`logits.sink_tangent`); their share of P is in the statistics.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax.attention.call import AuxArrays
from jaxsoftmax.attention.logits import Logits, cap_grad
from jaxsoftmax.attention.masks import (MaskSpec, key_block_ranges, narrow_ranges,
                                        walk_block_ranges)
from jaxsoftmax.attention.triton.tiling import (MIN_BLOCK, SHARED_MEMORY, Aux, BlockSizes,
                                                Dims, ScoreTerms,
                                                key_block, load_span, max_or_inf,
                                                probabilities, query_block,
                                                query_block_launch, query_plane_spec,
                                                query_spans, scores, split_span_refs)


def _tangent_kernel(q_ref, k_ref, v_ref, q_dot_ref, k_dot_ref, v_dot_ref, o_ref, m_ref,
                    log2_l_ref, *refs, dims: Dims, spec: MaskSpec, blocks: BlockSizes,
                    aux: Aux, logits: Logits, q_block, exp2, bias_dot: bool):
  aux_refs, refs = AuxArrays.split_refs(refs, aux.present)
  (first_ref, end_ref), refs = split_span_refs(refs, aux)
  bias_dot_ref, o_dot_ref = refs if bias_dot else (None, *refs)
  kv_seg_ref = aux_refs.kv_segments
  bq, bk = blocks.block_q_dq, blocks.block_k_dq
  q0 = q_block(pl.program_id(0)) * bq
  block = query_block(q_ref, aux_refs, q0=q0, block_q=bq, dims=dims)
  q_idx, q = block.idx, block.tile
  q_dot = pallas.load(q_dot_ref, mask=block.mask, other=0)
  m = max_or_inf(pallas.load(m_ref, mask=block.ok, other=-jnp.inf))
  log2_l = pallas.load(log2_l_ref, mask=block.ok, other=0)
  terms = ScoreTerms(aux, aux_refs, logits.factor, dims, one_sided=spec.one_sided)
  slope = terms.slope()
  tile_max = terms.tile_maxima(m, slope, q_idx, q0)  # keyed by a block's `masked`

  def step(j, carry, *, masked: bool):
    keys = key_block(j * bk, bk, dims, terms, block, masked=masked)

    def tile(carry):
      acc, r = carry
      k = keys.load(k_ref, keys.k_mask)
      x, tanh = scores(logits, q, k)
      x = terms.add(x, **keys.place, masked=masked, slope=slope, q0=q0)
      allowed = keys.allowed(spec, kv_seg_ref, block) if masked else None
      p = probabilities(logits, exp2, x, tile_max[masked][:, None], log2_l[:, None],
                        allowed)
      k_dot = keys.load(k_dot_ref, keys.k_mask)
      qk_dot = pallas.dot(q_dot, k, trans_b=True) + pallas.dot(q, k_dot, trans_b=True)
      # The logits' tangent; ds/dx of the soft cap is the same 1 - tanh² as the backward's.
      s_dot = cap_grad(qk_dot * logits.scale, tanh)
      if bias_dot_ref is not None:
        s_dot = s_dot + terms.plane_tile(bias_dot_ref, aux.bias, None, keys.place["rows"],
                                         keys.place["cols"], q_idx, keys.idx,
                                         s_dot.shape).astype(jnp.float32)
      p_s_dot = p * s_dot
      v = keys.load(v_ref, keys.v_mask)
      v_dot = keys.load(v_dot_ref, keys.v_mask)
      acc = (acc + pallas.dot(p_s_dot.astype(v.dtype), v)
             + pallas.dot(p.astype(v_dot.dtype), v_dot))
      return acc, r + jnp.sum(p_s_dot, axis=1)

    return tile(carry)

  carry = (jnp.zeros((bq, dims.Hv_pad), jnp.float32), jnp.zeros((bq,), jnp.float32))
  ranges = narrow_ranges(key_block_ranges(spec, q0, bq, bk, block.kv_length, block.q_length),
                         load_span(first_ref, end_ref))
  acc, r = walk_block_ranges(ranges, step, carry)
  o = pallas.load(o_ref, mask=block.o_mask, other=0).astype(jnp.float32)
  pallas.store(o_dot_ref, (acc - r[:, None] * o).astype(o_dot_ref.dtype),
               mask=block.o_mask)


def fit_shared_memory(blocks: BlockSizes, dims: Dims, itemsize: int, *,
                      bias_dot: bool) -> BlockSizes:
  """``blocks`` with the tangent kernel's stages and tiles cut until they fit
  `SHARED_MEMORY`. It streams four key-side tiles per block (K, K̇, V, V̇: 2·bk·(H + Hv))
  and Ḃ's tile where a bias has a tangent, each stage of the pipeline a copy, beside
  the resident Q and Q̇ tiles; the dQ kernel whose tiles it borrows streams two (at H
  = 128 in bfloat16, three stages of 128 x 64 tiles asked for 256 KiB on an H200)."""
  def need(bq, bk, stages):
    per_stage = 2 * bk * (dims.H_pad + dims.Hv_pad) * itemsize + bias_dot * bq * bk * itemsize
    return 2 * bq * dims.H_pad * itemsize + stages * per_stage

  bq, bk, stages = blocks.block_q_dq, blocks.block_k_dq, blocks.num_stages_bwd
  while need(bq, bk, stages) > SHARED_MEMORY:
    if stages > 1:
      stages -= 1
    elif bk > MIN_BLOCK:
      bk //= 2
    elif bq > MIN_BLOCK:
      bq //= 2
    else:
      break
  return dataclasses.replace(blocks, block_q_dq=bq, block_k_dq=bk, num_stages_bwd=stages)


def tangent(q, k, v, o, m, log2_l, q_dot, k_dot, v_dot, aux_arrays, *, spec: MaskSpec,
            blocks: BlockSizes, scale: float, softcap: float | None, interpret: bool,
            bias_dot=None):
  """Ȯ (B, T, N, Hv) in q's dtype for the tangents q_dot, k_dot, v_dot (and bias_dot,
  shaped as the bias in ``aux_arrays``), from any forward's o (float32 where it has one)
  and row statistics m, log2_l (B, N, T)."""
  dims = Dims.of(q, k, v)
  blocks = fit_shared_memory(blocks, dims, q.dtype.itemsize, bias_dot=bias_dot is not None)
  spans = query_spans(aux_arrays, blocks.block_q_dq, blocks.block_k_dq, dims)
  aux, aux_arrays = Aux.of(aux_arrays)
  launch = query_block_launch(dims, aux, block_q=blocks.block_q_dq,
                              block_k=blocks.block_k_dq, last_first=spec.is_causal)
  q_tile, o_tile, stat_tile = launch.q_tile, launch.o_tile, launch.stat_tile
  bias_specs, bias_inputs = [], []
  if bias_dot is not None:
    kv_rows = pl.cdiv(dims.S, blocks.block_k_dq) * blocks.block_k_dq
    bias_specs = [query_plane_spec(aux.bias, blocks.block_q_dq, kv_rows, launch.q_block)]
    bias_inputs = [bias_dot]
  kernel = functools.partial(
      _tangent_kernel, dims=dims, spec=spec, blocks=blocks, aux=aux,
      logits=Logits(scale, softcap, fused=q.dtype != jnp.float32), q_block=launch.q_block,
      exp2=pallas.exp2(interpret), bias_dot=bias_dot is not None)
  return pallas.pallas_call(
      kernel, name="attention_tangent", grid=launch.grid,
      in_specs=[q_tile, launch.kv_all, launch.v_all, q_tile, launch.kv_all, launch.v_all,
                o_tile, stat_tile, stat_tile, *launch.aux_specs, *launch.span_specs,
                *bias_specs],
      out_specs=o_tile,
      out_shape=jax.ShapeDtypeStruct((*q.shape[:3], dims.Hv), q.dtype),
      num_warps=blocks.num_warps_bwd, num_stages=blocks.num_stages_bwd, interpret=interpret,
  )(q, k, v, q_dot, k_dot, v_dot, o, m, log2_l, *aux_arrays,
    *spans, *bias_inputs)
