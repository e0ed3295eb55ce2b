"""FlashAttention forward (FlashAttention-2, Algorithm 1) as a Pallas kernel.

One program per (query block, batch row, query head). It keeps its query tile in
registers and walks the key/value blocks that its masks allow (`masks.key_block_ranges`),
merging each block into the online state (m, l) and the unnormalized output
acc = sum_j exp(s_j - m) v_j, with s = x · factor the logits (`logits.Logits`):

    m' = max(m, rowmax(x));  α = exp(s(m) - s(m'));  p = exp(s - s(m'))
    l' = α l + rowsum(p);    acc' = α acc + p v

At the end o = acc / l. The log-sum-exp lse = s(m) + log(l) is saved as its two parts,
m (in x's units) and log2(l), both float32: a float32 lse near 100 is rounded by 1e-5,
which would cost float32 inputs' gradients that much, while x - m is exact near the
maximum. A row with no allowed key has l = 0: it gets o = 0, m = -inf (lse = -inf). Attention
sinks join each row's (m, l) in the epilogue, as one more key without a value
(`logits.join_sink`).
FLOPs: 4·B·N·T·S·H, about halved by causal masking since those blocks are skipped.
Under causal masking the query blocks run last-first (`tiling.query_block_launch`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax.attention.call import AuxArrays
from jaxsoftmax.attention.logits import Logits, join_sink
from jaxsoftmax.attention.masks import (MaskSpec, key_block_ranges, narrow_ranges,
                                        walk_block_ranges)
from jaxsoftmax.attention.triton.tiling import (Aux, BlockSizes, Dims, ScoreTerms,
                                                forward_stages, key_block, load_span,
                                                query_block, query_block_launch,
                                                query_spans, scores, split_span_refs)
from jaxsoftmax._core.state import safe_shift


def _forward_kernel(q_ref, k_ref, v_ref, *refs, dims: Dims, spec: MaskSpec,
                    blocks: BlockSizes, aux: Aux, logits: Logits, q_block, exp2,
                    with_sinks: bool):
  aux_refs, refs = AuxArrays.split_refs(refs, aux.present)
  sink_ref, refs = (refs[0], refs[1:]) if with_sinks else (None, refs)
  (first_ref, end_ref), refs = split_span_refs(refs, aux)
  o_ref, m_ref, log2_l_ref, *o32_ref = refs
  kv_seg_ref = aux_refs.kv_segments
  bq, bk = blocks.block_q, blocks.block_k
  q0 = q_block(pl.program_id(0)) * bq
  block = query_block(q_ref, aux_refs, q0=q0, block_q=bq, dims=dims)
  q_idx, q_ok, o_mask, q = block.idx, block.ok, block.o_mask, block.tile
  q_length, kv_length = block.q_length, block.kv_length

  terms = ScoreTerms(aux, aux_refs, logits.factor, dims, one_sided=spec.one_sided)
  slope = terms.slope()
  # The running maximum m is the true one; an unmasked tile's x leaves out one-sided
  # ALiBi's row term (`ScoreTerms.add`), so its row maxima get it back and its exponent
  # is taken from m less it.
  frame_row = terms.alibi_row(slope, q_idx, q0, masked=False)

  def step(j, carry, *, masked: bool):
    keys = key_block(j * bk, bk, dims, terms, block, masked=masked)
    row = None if masked else frame_row

    def fold(carry):
      m, l, acc = carry
      k = keys.load(k_ref, keys.k_mask)
      x, _ = scores(logits, q, k)
      x = terms.add(x, **keys.place, masked=masked, slope=slope, q0=q0)
      if masked:
        x = jnp.where(keys.allowed(spec, kv_seg_ref, block), x, -jnp.inf)
      x_max = jnp.max(x, axis=1)
      m_new = jnp.maximum(m, x_max if row is None else x_max + row)
      shift = safe_shift(m_new)
      p = exp2(logits.exponent(x, (shift if row is None else shift - row)[:, None]))
      alpha = exp2(logits.exponent(m, shift))
      v = keys.load(v_ref, keys.v_mask)
      acc = acc * alpha[:, None] + pallas.dot(p.astype(v.dtype), v)
      return m_new, l * alpha + jnp.sum(p, axis=1), acc

    return fold(carry)

  ranges = narrow_ranges(key_block_ranges(spec, q0, bq, bk, kv_length, q_length),
                         load_span(first_ref, end_ref))
  carry = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
           jnp.zeros((bq, dims.Hv_pad), jnp.float32))
  m, l, acc = walk_block_ranges(ranges, step, carry)

  some = l != 0  # rows with an allowed key; a NaN input's NaN l stays NaN (NaN != 0)
  if q_length is not None:
    some = some & (q_idx < q_length)
  has_l = some
  if sink_ref is not None:  # every row joins its sink, from an empty state if not `some`
    m, l, alpha = join_sink(logits, jnp.where(some, m, -jnp.inf), jnp.where(some, l, 0.0),
                            jnp.max(pallas.load(sink_ref)), exp2)
    acc = acc * alpha[:, None]
    has_l = l != 0
  l_safe = jnp.where(has_l, l, 1.0)
  o = jnp.where(some[:, None], acc / l_safe[:, None], 0.0)
  pallas.store(o_ref, o.astype(o_ref.dtype), mask=o_mask)
  if o32_ref:
    pallas.store(o32_ref[0], o, mask=o_mask)
  # A NaN l makes m NaN too: the GPU's max may skip NaN, and lse and the backward's P
  # must carry it (docs/numerics.md).
  pallas.store(m_ref, jnp.where(has_l, jnp.where(l == l, m, jnp.nan), -jnp.inf), mask=q_ok)
  pallas.store(log2_l_ref, jnp.log2(l_safe), mask=q_ok)


def forward(q, k, v, aux_arrays, *, spec: MaskSpec, blocks: BlockSizes, scale: float,
            softcap: float | None, interpret: bool, float32_output: bool = False,
            sinks=None):
  """(o (B, T, N, Hv), m (B, N, T), log2_l (B, N, T)) for q (B, T, N, H), k (B, S, K, H)
  and v (B, S, K, Hv); `logits.lse` combines the last two. With ``float32_output`` (16-bit inputs,
  for the backward) also o in float32: delta = rowsum(dO ∘ O) from the rounded o loses
  the cancellation in dP - delta when attention is nearly one-hot (large logits), which
  made bfloat16 dQ 3x less accurate than XLA's. ``sinks``: None, or (B, N) float32
  logits that join each row's softmax in the epilogue (`logits.join_sink`)."""
  dims = Dims.of(q, k, v)
  aux, given = Aux.of(aux_arrays)
  blocks = forward_stages(blocks, dims, q.dtype.itemsize,
                          aux.plane_tile_bytes(aux_arrays, blocks.block_q, blocks.block_k))
  launch = query_block_launch(dims, aux, block_q=blocks.block_q, block_k=blocks.block_k,
                              last_first=spec.is_causal)
  stat_shape = jax.ShapeDtypeStruct((dims.B, dims.N, dims.T), jnp.float32)
  logits = Logits(scale, softcap, fused=q.dtype != jnp.float32)
  kernel = functools.partial(_forward_kernel, dims=dims, spec=spec, blocks=blocks, aux=aux,
                             logits=logits, q_block=launch.q_block,
                             exp2=pallas.exp2(interpret), with_sinks=sinks is not None)
  # One sink per program (batch row, query head), as the ALiBi slopes' (1,) blocks.
  sink_inputs, sink_specs = [], []
  if sinks is not None:
    sink_inputs = [sinks.astype(jnp.float32).reshape(dims.B * dims.N)]
    sink_specs = [pl.BlockSpec((1,), lambda i, b, n: (b * dims.N + n,))]
  spans = query_spans(aux_arrays, blocks.block_q, blocks.block_k, dims)
  o_tile, stat_tile = launch.o_tile, launch.stat_tile
  o_shape = (*q.shape[:3], dims.Hv)
  return pallas.pallas_call(
      kernel, name="attention_forward", grid=launch.grid,
      in_specs=[launch.q_tile, launch.kv_all, launch.v_all, *launch.aux_specs, *sink_specs,
                *launch.span_specs],
      out_specs=[o_tile, stat_tile, stat_tile] + [o_tile] * float32_output,
      out_shape=[jax.ShapeDtypeStruct(o_shape, q.dtype), stat_shape, stat_shape]
      + [jax.ShapeDtypeStruct(o_shape, jnp.float32)] * float32_output,
      num_warps=blocks.num_warps, num_stages=blocks.num_stages, interpret=interpret,
  )(q, k, v, *given, *sink_inputs, *spans)
