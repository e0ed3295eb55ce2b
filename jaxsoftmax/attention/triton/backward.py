"""FlashAttention backward (FlashAttention-2, Algorithm 2) as two Pallas kernels.

Nothing of size T x S is stored: probabilities are recomputed from the saved lse (as the
forward's m and log2(l), see `forward`),

    P = exp(S - lse);  dV = Pᵀ dO;  dP = dO Vᵀ;  dS = P ∘ (dP - delta)
    dQ = dS K · scale;  dK = dSᵀ Q · scale;     delta = rowsum(dO ∘ O)

with dS multiplied by 1 - tanh²(s / cap) under a soft cap. A row that had no allowed key
(or lies past its query length) has m = -inf: it is read as +inf, so its P, and all its
gradients, are exactly 0.

- dK/dV kernel: one program per (key block, batch row, K/V head); it keeps its K, V tiles
  and accumulators and walks the query blocks that can see them, for every query head of
  its group (GQA: dK, dV are summed over the group in registers). It works on the
  transposed scores Sᵀ = K Qᵀ, so that Pᵀ and dSᵀ come out of registers in the layout the
  next products take, and applies element masks on the boundary query blocks only.
- dQ kernel: one program per (query block, batch row, query head), walking the key
  blocks in the forward's three ranges (element masks on the boundary blocks only).
FLOPs: 2.5x the forward's (the two kernels run 3.5x, recomputing S and dP in each; in
float16 each kernel adds one product for dS, see `logits.score_grad_terms`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax.attention.call import AuxArrays
from jaxsoftmax.attention.logits import (Logits, cap_grad, row_delta, score_grad,
                                         score_grad_terms)
from jaxsoftmax.attention.masks import (MaskSpec, cdiv, element_mask, key_block_ranges,
                                        narrow_ranges, query_block_ranges,
                                        walk_block_ranges)
from jaxsoftmax.attention.triton.tiling import (Aux, BlockSizes, Dims, Plane, ScoreTerms,
                                                block_rows, dq_stages, key_block,
                                                live_block_spans,
                                                load_scalar, load_span, max_or_inf,
                                                probabilities, query_block,
                                                query_block_launch, query_plane_spec,
                                                query_spans, scores, span_sources,
                                                span_spec,
                                                split_span_refs)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, m_ref, log2_l_ref, delta_ref, *refs, dims: Dims,
                 spec: MaskSpec, blocks: BlockSizes, aux: Aux, logits: Logits, exp2,
                 chunk: int | None, barrier):
  aux_refs, refs = AuxArrays.split_refs(refs, aux.present)
  (first_ref, end_ref), (dk_ref, dv_ref) = split_span_refs(refs, aux)
  q_len_ref, kv_len_ref, q_seg_ref, kv_seg_ref = aux_refs.lengths_and_segments
  bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
  group = dims.N // dims.K
  k0 = pl.program_id(0) * bk
  k_idx, kv_ok = block_rows(k0, bk, dims.S)
  h_ok, hv_ok = dims.head_ok(), dims.head_ok(value=True)
  k_mask = dims.tile_mask(kv_ok, h_ok, bk)
  v_mask = dims.tile_mask(kv_ok, hv_ok, bk, value=True)
  k = pallas.load(k_ref, mask=k_mask, other=0)
  v = pallas.load(v_ref, mask=v_mask, other=0)
  q_length, kv_length = load_scalar(q_len_ref), load_scalar(kv_len_ref)
  k_seg = None if kv_seg_ref is None else pallas.load(kv_seg_ref, mask=kv_ok, other=-2)
  terms = ScoreTerms(aux, aux_refs, logits.factor, dims, transposed=True,
                     one_sided=spec.one_sided)

  def step(i, carry, *, g, masked: bool):
    q0 = i * bq
    q_idx, q_ok = block_rows(q0, bq, dims.T)
    rows = pl.ds(q0, bq)
    place = dict(q_idx=q_idx, k_idx=k_idx, rows=rows, cols=pl.ds(0, bk), head=g)
    user_mask = terms.mask((bk, bq), **place)

    def block(carry):
      dk, dv = carry
      q_mask = dims.tile_mask(q_ok, h_ok, bq)
      do_mask = dims.tile_mask(q_ok, hv_ok, bq, value=True)
      # Query rows past T load as 0 with m = +inf: their P is 0, no element mask needed.
      q = pallas.load(q_ref.at[rows, g, :], mask=q_mask, other=0)
      do = pallas.load(do_ref.at[rows, g, :], mask=do_mask, other=0)
      m = max_or_inf(pallas.load(m_ref.at[g, rows], mask=q_ok, other=-jnp.inf))
      log2_l = pallas.load(log2_l_ref.at[g, rows], mask=q_ok, other=0)
      delta = pallas.load(delta_ref.at[g, rows], mask=q_ok, other=0)
      slope = terms.slope(g)
      m = terms.tile_max(m, slope, q_idx, q0, masked=masked)
      x_t, tanh_t = scores(logits, k, q)  # (bk, bq)
      x_t = terms.add(x_t, **place, masked=masked, slope=slope, q0=q0)
      allowed = None
      if masked:
        q_seg = None
        if q_seg_ref is not None:
          q_seg = pallas.load(q_seg_ref.at[rows], mask=q_idx < dims.T, other=-1)
        allowed = element_mask(spec, q_idx[None, :], k_idx[:, None], kv_length,
                               None if q_seg is None else q_seg[None, :],
                               None if k_seg is None else k_seg[:, None])
        if user_mask is not None:
          allowed = allowed & user_mask
      p_t = probabilities(logits, exp2, x_t, m[None, :], log2_l[None, :], allowed)
      dv = dv + pallas.dot(p_t.astype(do.dtype), do)
      dp_t = pallas.dot(v, do, trans_b=True)
      ds_t = score_grad(p_t, dp_t, delta[None, :], tanh_t)
      dk = dk + _score_grad_dot(ds_t, q)
      return dk, dv

    return block(carry)

  def final(dk, dv):
    """dK scaled; keys past the length (not masked in the interior) get 0."""
    dk = dk * logits.scale
    if kv_length is not None:
      used = (k_idx < kv_length)[:, None]
      dk, dv = jnp.where(used, dk, 0.0), jnp.where(used, dv, 0.0)
    return dk, dv

  ranges = query_block_ranges(spec, k0, bq, bk, kv_length, q_length, pl.cdiv(dims.T, bq))

  def head_ranges(g):
    """The walk's ranges for the group's query head g: within the query blocks its
    mask and the segment ids leave some key of this block to
    (`tiling.live_block_spans`)."""
    heads = aux.spans is not None and aux.spans.heads
    return narrow_ranges(ranges, load_span(first_ref, end_ref, g if heads else None))

  zeros = (jnp.zeros((bk, dims.H_pad), jnp.float32),
           jnp.zeros((bk, dims.Hv_pad), jnp.float32))
  if chunk is None:
    def head(g, carry):
      return walk_block_ranges(head_ranges(g), functools.partial(step, g=g), carry)

    dk, dv = final(*lax.fori_loop(0, group, head, zeros))
    pallas.store(dk_ref, dk.astype(dk_ref.dtype), mask=k_mask)
    pallas.store(dv_ref, dv.astype(dv_ref.dtype), mask=v_mask)
    return

  # float32: the sums over the query rows kept in the (float32) outputs, see
  # _walk_in_chunks.
  pallas.store(dk_ref, zeros[0], mask=k_mask)
  pallas.store(dv_ref, zeros[1], mask=v_mask)

  def add_to_outputs(part):
    barrier()  # the tiles the last add stored, whichever threads stored them
    dk, dv = final(*part)
    pallas.store(dk_ref, pallas.load(dk_ref, mask=k_mask, other=0) + dk, mask=k_mask)
    pallas.store(dv_ref, pallas.load(dv_ref, mask=v_mask, other=0) + dv, mask=v_mask)

  def head_in_chunks(g, unused):
    _walk_in_chunks(head_ranges(g), functools.partial(step, g=g), zeros, chunk,
                    add_to_outputs)
    return unused

  lax.fori_loop(0, group, head_in_chunks, 0)


def _walk_in_chunks(ranges, body, zeros, chunk: int, add):
  """`walk_block_ranges` in runs of at most ``chunk`` blocks, each summed from ``zeros``
  and handed to ``add`` (float32: which adds it to the outputs).

  Triton folds ``dk + dot(ds, q)`` into the product's accumulator, so one walk adds every
  query row into dK and dV one after another. Over 2 x 4097 rows (causal, T 4097, S 1000,
  head dim 256, GQA 2) that rounding reached 1.22e-5 in dK, past twice XLA's 5.2e-6, on
  an H200; a numpy model of the two orders gives 1.21e-5 one row at a time and 1.3e-6
  in 64-row tiles. Summed in the outputs, the runs take no registers beyond the walk's.
  """
  lo, full_lo, full_hi, hi = ranges
  add(lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), zeros))

  def run(c, unused):
    start = full_lo + c * chunk
    add(lax.fori_loop(start, jnp.minimum(start + chunk, full_hi),
                      functools.partial(body, masked=False), zeros))
    return unused

  lax.fori_loop(0, cdiv(full_hi - full_lo, chunk), run, 0)
  add(lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), zeros))


def _score_grad_dot(ds, x):
  """ds · x on the tensor cores, with ds as `logits.score_grad_terms` of x's dtype."""
  terms = score_grad_terms(ds, x.dtype)
  out = pallas.dot(terms[0], x)
  for term in terms[1:]:
    out = out + pallas.dot(term, x)
  return out


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, m_ref, log2_l_ref, delta_ref, *refs, dims: Dims,
               spec: MaskSpec, blocks: BlockSizes, aux: Aux, logits: Logits, q_block, exp2,
               dbias_atomic: bool = False):
  aux_refs, refs = AuxArrays.split_refs(refs, aux.present)
  (first_ref, end_ref), refs = split_span_refs(refs, aux)
  if dbias_atomic:  # the zeroed target comes in aliased to its output: that one adds
    refs = refs[1:]
  dq_ref, *dbias_ref = refs
  kv_seg_ref = aux_refs.kv_segments
  bq, bk = blocks.block_q_dq, blocks.block_k_dq
  q0 = q_block(pl.program_id(0)) * bq
  block = query_block(q_ref, aux_refs, q0=q0, block_q=bq, dims=dims)
  q_idx, q_ok, q_mask, q = block.idx, block.ok, block.mask, block.tile
  q_length, kv_length = block.q_length, block.kv_length
  do = pallas.load(do_ref, mask=block.o_mask, other=0)
  m = max_or_inf(pallas.load(m_ref, mask=q_ok, other=-jnp.inf))
  log2_l = pallas.load(log2_l_ref, mask=q_ok, other=0)
  delta = pallas.load(delta_ref, mask=q_ok, other=0)
  terms = ScoreTerms(aux, aux_refs, logits.factor, dims, one_sided=spec.one_sided)
  slope = terms.slope()
  tile_max = terms.tile_maxima(m, slope, q_idx, q0)  # keyed by a block's `masked`
  dbias = (_DBiasPartial(dbias_ref[0], aux.bias, q_idx, q0, bq, dims, dbias_atomic)
           if dbias_ref else None)

  def step(j, carry, *, masked: bool):
    keys = key_block(j * bk, bk, dims, terms, block, masked=masked)

    def fold(carry):
      dq, dbias_sum = carry
      k = keys.load(k_ref, keys.k_mask)
      v = keys.load(v_ref, keys.v_mask)
      x, tanh = scores(logits, q, k)
      x = terms.add(x, **keys.place, masked=masked, slope=slope, q0=q0)
      allowed = keys.allowed(spec, kv_seg_ref, block) if masked else None
      p = probabilities(logits, exp2, x, tile_max[masked][:, None], log2_l[:, None],
                        allowed)
      dp = pallas.dot(do, v, trans_b=True)
      ds = score_grad(p, dp, delta[:, None], None)  # the logits' (and the bias's)
      if dbias is not None:
        dbias_sum = dbias.add(ds, dbias_sum, k0=keys.k0, k_idx=keys.idx, block_k=bk)
      return dq + _score_grad_dot(cap_grad(ds, tanh), k), dbias_sum

    return fold(carry)

  carry = (jnp.zeros((bq, dims.H_pad), jnp.float32),
           None if dbias is None else dbias.start(bk))
  ranges = narrow_ranges(key_block_ranges(spec, q0, bq, bk, kv_length, q_length),
                         load_span(first_ref, end_ref))
  dq, dbias_sum = walk_block_ranges(ranges, step, carry)
  pallas.store(dq_ref, (dq * logits.scale).astype(dq_ref.dtype), mask=q_mask)
  if dbias is not None:
    dbias.finish(dbias_sum)


class _DBiasPartial(NamedTuple):
  """dbias in a dQ program, summed over the axes the bias broadcasts along. Stored: per
  key block where the bias has a key axis (its block zeroed first, for the blocks the
  walk skips), else summed across the walk and stored once; one row per query block
  where it has no query axis (the sum over query blocks, batch rows and heads is XLA's,
  `_dbias`). ``atomic`` (`_dbias_target`): added instead into a zeroed float32 array of
  the bias's own shape (padded to whole blocks), which every program of the bias's
  batch row and head shares."""

  ref: Any
  plane: Plane
  q_idx: Any
  q0: Any
  block_q: int
  dims: Dims
  atomic: bool = False

  def _all_rows(self):
    """The block's rows as an int32 slice. In interpret mode under jax_enable_x64 a
    store's indices must share one integer type (its discharge is a dynamic_slice),
    and a bare ``:`` or a Python-int loop index would be int64: the column starts are
    cast to int32 too."""
    return pl.ds(jnp.int32(0), self.block_q if self.plane.rows else 1)

  def _rows(self, ds):
    return ds if self.plane.rows else jnp.sum(ds, axis=0, keepdims=True)

  def _row_ok(self, cols: int):
    if not self.plane.rows:
      return None
    return jnp.broadcast_to((self.q_idx < self.dims.T)[:, None], (self.block_q, cols))

  def _atomic_rows(self):
    """The program's rows of the shared target: its query block, or its one row."""
    if self.plane.rows:
      return pl.ds(lax.convert_element_type(self.q0, jnp.int32), self.block_q)
    return pl.ds(jnp.int32(0), 1)

  def _add_atomic(self, tile, k0, cols: int):
    """Adds ``tile`` (rows or one row, by ``cols``) at key column k0; rows past T add 0
    (atomic adds take no mask: the target is padded to whole blocks instead)."""
    row_ok = self._row_ok(cols)
    if row_ok is not None:
      tile = jnp.where(row_ok, tile, 0.0)
    pallas.atomic_add(self.ref, (self._atomic_rows(), pl.ds(k0, cols)), tile)

  def start(self, block_k: int):
    """The walk's carry (None, or the running sum over keys), after zeroing the block."""
    if not self.plane.cols:
      return jnp.zeros((self.block_q if self.plane.rows else 1, 1), jnp.float32)
    if self.atomic:  # the target starts at zero
      return None
    rows = self.block_q if self.plane.rows else 1

    def zero(j, unused):
      k_idx = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
      ok = jnp.broadcast_to((k_idx < self.dims.S)[None, :], (rows, block_k))
      row_ok = self._row_ok(block_k)
      pallas.store(self.ref.at[self._all_rows(), pl.ds(jnp.int32(j * block_k), block_k)],
                   jnp.zeros((rows, block_k), jnp.float32),
                   mask=ok if row_ok is None else ok & row_ok)
      return unused

    lax.fori_loop(0, pl.cdiv(self.dims.S, block_k), zero, 0)
    return None

  def add(self, ds, total, *, k0, k_idx, block_k: int):
    """Takes the key block's ds (block_q, block_k) into dbias; returns the carry."""
    if not self.plane.cols:
      return total + jnp.sum(self._rows(ds), axis=1, keepdims=True)
    tile = self._rows(ds)
    if self.atomic:  # keys past S are masked: their ds is 0
      self._add_atomic(tile, lax.convert_element_type(k0, jnp.int32), block_k)
      return total
    ok = jnp.broadcast_to((k_idx < self.dims.S)[None, :], tile.shape)
    row_ok = self._row_ok(block_k)
    pallas.store(self.ref.at[self._all_rows(), pl.ds(jnp.int32(k0), block_k)], tile,
                 mask=ok if row_ok is None else ok & row_ok)
    return total

  def finish(self, total):
    if not self.plane.cols:
      if self.atomic:
        self._add_atomic(total, jnp.int32(0), 1)
        return
      row_ok = self._row_ok(1)
      pallas.store(self.ref, total, mask=row_ok)


def backward(q, k, v, o, m, log2_l, do, aux_arrays, *, spec: MaskSpec, blocks: BlockSizes,
             scale: float, softcap: float | None, interpret: bool, grad_dtype=None,
             delta=None, with_dbias: bool = False, deterministic: bool = False):
  """(dq, dk, dv) for the forward's inputs, its output o (float32 where it has one) and
  its row statistics m and log2_l (B, N, T); in the inputs' dtype, or in ``grad_dtype``
  (float32 for partial gradients that are summed afterwards, as context parallelism's).
  ``delta``: rowsum(dO ∘ O) (B, N, T) where the caller has it (then o is not read).
  ``with_dbias``: also dbias, the bias's shape and dtype, from the dQ kernel, which adds
  it atomically where the bias broadcasts (`_dbias_atomic`) unless ``deterministic``."""
  grad_dtype = q.dtype if grad_dtype is None else grad_dtype
  dims = Dims.of(q, k, v)
  aux_arrays_in = aux_arrays
  aux, aux_arrays = Aux.of(aux_arrays)
  group = dims.N // dims.K
  if delta is None:  # one fused XLA pass over O and dO
    delta = row_delta(o, do)
  statics = dict(dims=dims, spec=spec, blocks=blocks, aux=aux,
                 logits=Logits(scale, softcap, fused=q.dtype != jnp.float32),
                 exp2=pallas.exp2(interpret))
  common = dict(num_warps=blocks.num_warps_bwd, num_stages=blocks.num_stages_bwd,
                interpret=interpret)

  # dK/dV: grid (key block, batch, K/V head); all query heads of the group, all queries.
  bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
  n_k_blocks = pl.cdiv(dims.S, bk)
  q_rows = pl.cdiv(dims.T, bq) * bq
  q_group, do_group = (pl.BlockSpec((None, q_rows, group, width),
                                    lambda j, b, h: (b, 0, h, 0))
                       for width in (dims.H_pad, dims.Hv_pad))
  k_tile, v_tile = (pl.BlockSpec((None, bk, None, width), lambda j, b, h: (b, j, h, 0))
                    for width in (dims.H_pad, dims.Hv_pad))
  stat_group = pl.BlockSpec((None, group, q_rows), lambda j, b, h: (b, h, 0))
  # float32: dK and dV summed 8 query blocks (256 rows) at a time, see _walk_in_chunks.
  chunk = 8 if q.dtype == grad_dtype == jnp.float32 else None
  spans, span_specs = [], []
  if aux.spans is not None:  # per key block, the query blocks the masks leave a key to
    spans = live_block_spans(*span_sources(aux_arrays_in), block_rows=bk, block_cols=bq,
                             n_col_blocks=pl.cdiv(dims.T, bq), transposed=True)
    span_specs = 2 * [span_spec(aux.spans, lambda j, b, h: (b, h, j),
                                blocked=aux.spans.cols, heads=group)]
  dk, dv = pallas.pallas_call(
      functools.partial(_dkdv_kernel, chunk=chunk, barrier=pallas.barrier(interpret),
                        **statics),
      name="attention_backward_dkdv",
      grid=(n_k_blocks, dims.B, dims.K),
      in_specs=[q_group, k_tile, v_tile, do_group, stat_group, stat_group, stat_group,
                *aux.specs(q_rows=q_rows, q_index=lambda j, b, h: (b, 0), kv_rows=bk,
                           kv_index=lambda j, b, h: (b, j), batch_index=lambda j, b, h: b,
                           plane_spec=lambda p: _key_plane_spec(p, group, q_rows, bk),
                           slopes_spec=pl.BlockSpec((group,), lambda j, b, h: (h,))),
                *span_specs],
      out_specs=[k_tile, v_tile],
      out_shape=[jax.ShapeDtypeStruct(k.shape, grad_dtype),
                 jax.ShapeDtypeStruct(v.shape, grad_dtype)],
      **common,
  )(q, k, v, do, m, log2_l, delta, *aux_arrays, *spans)

  # dQ: grid (query block, batch, query head), walking the key blocks.
  launch = query_block_launch(dims, aux, block_q=blocks.block_q_dq,
                              block_k=blocks.block_k_dq, last_first=spec.is_causal)
  q_tile, stat_tile = launch.q_tile, launch.stat_tile
  out_specs, out_shape = [q_tile], [jax.ShapeDtypeStruct(q.shape, grad_dtype)]
  in_specs = [q_tile, launch.kv_all, launch.v_all, launch.o_tile, stat_tile, stat_tile,
              stat_tile, *launch.aux_specs, *launch.span_specs]
  inputs = [q, k, v, do, m, log2_l, delta, *aux_arrays,
            *query_spans(aux_arrays_in, blocks.block_q_dq, blocks.block_k_dq, dims)]
  atomic = with_dbias and not deterministic and _dbias_atomic(aux.bias)
  aliases = {}
  if atomic:
    target, target_spec = _dbias_target(aux.bias, dims, blocks)
    aliases = {len(inputs): 1}  # after dq
    in_specs.append(target_spec)
    inputs.append(target)
    out_specs.append(target_spec)
    out_shape.append(jax.ShapeDtypeStruct(target.shape, jnp.float32))
  elif with_dbias:
    partial = _dbias_partial_shape(aux.bias, dims, blocks.block_q_dq)
    plane = dataclasses.replace(aux.bias, batch=True, heads=True)  # one block per program
    out_specs.append(query_plane_spec(
        plane, blocks.block_q_dq, pl.cdiv(dims.S, blocks.block_k_dq) * blocks.block_k_dq,
        launch.q_block, row_blocks=True))
    out_shape.append(jax.ShapeDtypeStruct(partial, jnp.float32))
  plane_bytes = aux.plane_tile_bytes(aux_arrays_in, blocks.block_q_dq, blocks.block_k_dq)
  dbias_bytes = 0 if not with_dbias else 4 * (
      (blocks.block_q_dq if aux.bias.rows else 1) * (blocks.block_k_dq if aux.bias.cols else 1))
  dq_common = dict(common, num_stages=dq_stages(blocks, dims, q.dtype.itemsize, plane_bytes,
                                                dbias_bytes))
  dq, *dbias = pallas.pallas_call(
      functools.partial(_dq_kernel, q_block=launch.q_block, dbias_atomic=atomic,
                        **statics),
      name="attention_backward_dq", grid=launch.grid,
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases, **dq_common,
  )(*inputs)
  if not with_dbias:
    return dq, dk, dv
  bias = AuxArrays(*aux_arrays_in).bias
  if atomic:  # the target less its padding
    dbias = dbias[0][:, :, :bias.shape[2], :bias.shape[3]]
  else:
    dbias = _dbias(dbias[0], aux.bias)
  return dq, dk, dv, dbias.astype(bias.dtype)


def _key_plane_spec(plane: Plane, group: int, q_rows: int, block_k: int):
  """The BlockSpec of a mask or bias plane in the dK/dV kernel: the group's heads (one
  where N broadcasts), every query row, the program's key block."""
  return pl.BlockSpec(
      (None, group if plane.heads else 1, q_rows if plane.rows else 1,
       block_k if plane.cols else 1),
      lambda j, b, h: (b if plane.batch else 0, h if plane.heads else 0, 0,
                       j if plane.cols else 0))


def _dbias_atomic(plane: Plane) -> bool:
  """Whether dbias is added atomically into one array of the bias's shape: wherever the
  stored partial sums (`_dbias_partial_shape`) would be larger than the bias, as for a
  relative-position bias (1, N, T, S), B times (4 GiB of float32 for the benchmarks'
  4x4096x16 with a bfloat16 bias of 512 MiB), or a key bias (B, 1, 1, S), N times T over
  block_q. Not where gradients must be bit-identical from run to run: the adds' order
  varies (as the Hopper backward's dQ, `deterministic`)."""
  return not (plane.batch and plane.heads and plane.rows)


def _dbias_target(plane: Plane, dims: Dims, blocks: BlockSizes):
  """(zeros, BlockSpec): the float32 array the dQ kernel adds dbias into atomically, of
  the bias's shape with its query and key axes padded to whole blocks (atomic adds take
  no mask), and the spec that gives each program its batch row's and head's plane."""
  rows = pl.cdiv(dims.T, blocks.block_q_dq) * blocks.block_q_dq if plane.rows else 1
  cols = pl.cdiv(dims.S, blocks.block_k_dq) * blocks.block_k_dq if plane.cols else 1
  shape = (dims.B if plane.batch else 1, dims.N if plane.heads else 1, rows, cols)
  spec = pl.BlockSpec((None, None, rows, cols),
                      lambda i, b, n: (b if plane.batch else 0, n if plane.heads else 0,
                                       0, 0))
  return jnp.zeros(shape, jnp.float32), spec


def _dbias_partial_shape(plane: Plane, dims: Dims, block_q: int) -> tuple[int, ...]:
  """The dQ kernel's dbias partial sums: (B, N, T or one row per query block, S or 1)."""
  return (dims.B, dims.N, dims.T if plane.rows else pl.cdiv(dims.T, block_q),
          dims.S if plane.cols else 1)


def _dbias(partial, plane: Plane):
  """dbias, the bias's shape, from the dQ kernel's partial sums: summed over the query
  blocks, batch rows and heads along which the bias broadcasts."""
  axes = tuple(axis for axis, full in enumerate((plane.batch, plane.heads, plane.rows))
               if not full)
  return jnp.sum(partial, axis=axes, keepdims=True)

