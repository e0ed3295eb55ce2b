"""The Triton kernels of the linear cross-entropy: the forward (one program per block of
rows and range of the vocabulary, the online-softmax state of each logit tile folded in
registers) and the two kernel backwards, "atomic" and "two_kernels" (`api`'s
docstring)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax._core.state import safe_shift
from jaxsoftmax.linear_cross_entropy.logits import (F16_TOP, LOG2E, Options, Rows, capped,
                                                    logit_gradient, merged_state,
                                                    operand_terms, power_of_two_scale,
                                                    probabilities, sum_products)
from jaxsoftmax.linear_cross_entropy.tiling import Dims

__all__ = ["forward", "backward"]


def _logit_tile(x_ref, x_row0, w_ref, b_ref, r0, v0, dims: Dims, options: Options):
  """(s, ds/dz or None, column indices, column mask, row mask) of the float32 logit tile
  of rows [r0, r0 + block_rows), at rows [x_row0, ...) of ``x_ref`` (0 for a block of
  rows, r0 for all of them), and columns [v0, v0 + block_vocab) (``w_ref``, ``b_ref``:
  whole)."""
  t = dims.tiling
  bt, bv, bh = t.block_rows, t.block_vocab, t.block_hidden
  rows = r0 + jnp.arange(bt, dtype=jnp.int32)
  cols = v0 + jnp.arange(bv, dtype=jnp.int32)
  row_ok, col_ok = rows < dims.R, cols < dims.V

  def chunk(c, z):
    h = c * bh + jnp.arange(bh, dtype=jnp.int32)
    h_ok = h < dims.H
    x = pallas.load(x_ref.at[pl.ds(x_row0, bt), pl.ds(c * bh, bh)],
                    mask=row_ok[:, None] & h_ok[None, :], other=0)
    w = pallas.load(w_ref.at[pl.ds(c * bh, bh), pl.ds(v0, bv)],
                    mask=h_ok[:, None] & col_ok[None, :], other=0)
    return z + pallas.dot(x, w)

  z = lax.fori_loop(0, dims.hidden_chunks, chunk, jnp.zeros((bt, bv), jnp.float32))
  if options.has_bias:
    z = z + pallas.load(b_ref.at[pl.ds(v0, bv)], mask=col_ok, other=0).astype(
        jnp.float32)[None, :]
  return (*capped(z, options), cols, col_ok, row_ok)

def _forward_kernel(x_ref, w_ref, *refs, dims: Dims, options: Options, per: int):
  b_ref = refs[0] if options.has_bias else None
  y_ref, m_ref, l_ref, label_ref, sum_ref = refs[1 if options.has_bias else 0:]
  bt, bv = dims.tiling.block_rows, dims.tiling.block_vocab
  r0 = pl.program_id(0) * bt
  first = pl.program_id(1) * per
  tiles = jnp.minimum(per, dims.vocab_tiles - first)  # the last range may be shorter
  exp2 = pallas.exp2(options.interpret)
  labels = y_ref[...]

  def tile(k, carry):
    m, l, label, total = carry
    s, _, cols, col_ok, _ = _logit_tile(x_ref, 0, w_ref, b_ref, r0, (first + k) * bv, dims,
                                        options)
    s_in = jnp.where(col_ok[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, s_in.max(axis=1))
    # l is relative to safe_shift(m) (_core/state.py), so a +inf logit gives l = +inf and
    # lse = +inf, as jax.nn.logsumexp does; the empty state's l = 0 stays 0 however far
    # the shift moves.
    shift = safe_shift(m_new)
    scaled = jnp.where(l > 0, l * exp2((safe_shift(m) - shift) * LOG2E), l)
    l = scaled + exp2((s_in - shift[:, None]) * LOG2E).sum(axis=1)
    label = label + jnp.where(cols[None, :] == labels[:, None], s, 0.0).sum(axis=1)
    total = total + jnp.where(col_ok[None, :], s, 0.0).sum(axis=1)
    return m_new, l, label, total

  zeros = jnp.zeros((bt,), jnp.float32)
  m, l, label, total = lax.fori_loop(0, tiles, tile,
                                     (jnp.full((bt,), -jnp.inf, jnp.float32), zeros,
                                      zeros, zeros))
  m_ref[...], l_ref[...], label_ref[...], sum_ref[...] = m, l, label, total


def forward(x, w, b, labels, dims: Dims, options: Options):
  """The Triton forward: per row, float32 (R,), the softmax state as its shift m and log
  l (`Rows`; lse = m + log l), the label's logit s_y and Σ_j s_j."""
  t = dims.tiling
  splits, per = dims.splits()
  R_pad = dims.row_blocks * t.block_rows
  H_pad = dims.hidden_chunks * t.block_hidden
  V_pad = dims.vocab_tiles * t.block_vocab
  rows = pl.BlockSpec((t.block_rows, H_pad), lambda i, s: (i, 0))
  whole_w = pl.BlockSpec((H_pad, V_pad), lambda i, s: (0, 0))
  in_specs = [rows, whole_w]
  args = [x, w]
  if options.has_bias:
    in_specs.append(pl.BlockSpec((V_pad,), lambda i, s: (0,)))
    args.append(b)
  in_specs.append(pl.BlockSpec((t.block_rows,), lambda i, s: (i,)))
  stat = pl.BlockSpec((None, t.block_rows), lambda i, s: (s, i))
  stat_shape = jax.ShapeDtypeStruct((splits, R_pad), jnp.float32)
  m, l, label, total = pallas.pallas_call(
      functools.partial(_forward_kernel, dims=dims, options=options, per=per),
      name="linear_cross_entropy_forward", grid=(dims.row_blocks, splits),
      in_specs=in_specs, out_specs=[stat] * 4, out_shape=[stat_shape] * 4,
      num_warps=t.num_warps, num_stages=t.num_stages, interpret=options.interpret,
  )(*args, jnp.pad(labels, (0, R_pad - dims.R)))
  m, log_l = merged_state(m, l)
  return m[:dims.R], log_l[:dims.R], label.sum(axis=0)[:dims.R], total.sum(axis=0)[:dims.R]


def _logit_grad(x_ref, x_row0, w_ref, b_ref, r0, v0, rows: Rows, dims: Dims,
                options: Options):
  """(ds, row mask, column mask): the float32 gradient of the loss with respect to the
  tile's logits z, for the `Rows` of its rows."""
  s, dsdz, cols, col_ok, row_ok = _logit_tile(x_ref, x_row0, w_ref, b_ref, r0, v0, dims,
                                              options)
  exp2 = pallas.exp2(options.interpret)
  p = jnp.where(row_ok[:, None] & col_ok[None, :],
                probabilities(s, rows, lambda t: exp2(t * LOG2E)), 0.0)
  return logit_gradient(p, dsdz, cols, col_ok, rows, dims, options), row_ok, col_ok

def _row_loads(refs, r0=None, rows=None) -> Rows:
  """The `Rows` of a block of rows: whole refs (``r0`` None) or row blocks."""
  if r0 is None:
    return Rows(*(ref[...] for ref in refs))
  return Rows(*(ref[pl.ds(r0, rows)] for ref in refs))

def _active(g, g_lse):
  """Whether a block of rows has a cotangent (blocks of ignored rows are skipped). A count,
  not jnp.any: Pallas' Triton lowering has no boolean reduction; NaN counts (!= 0)."""
  return jnp.sum((g != 0).astype(jnp.int32) + (g_lse != 0).astype(jnp.int32)) > 0

def _hidden_chunk(c, dims: Dims):
  """Columns [c·block_hidden, ...) of the hidden dim and which lie inside it."""
  bh = dims.tiling.block_hidden
  return pl.ds(c * bh, bh), c * bh + jnp.arange(bh, dtype=jnp.int32) < dims.H

def _atomic_kernel(x_ref, w_ref, *refs, dims: Dims, options: Options):
  """One program per (block of rows, vocabulary tile): its products go to dhidden,
  dweight and dbias by float32 atomic adds."""
  b_ref = refs[0] if options.has_bias else None
  row_refs = refs[1 if options.has_bias else 0:][:len(Rows._fields)]
  dx_ref, dw_ref, *db_ref = refs[-3 if options.has_bias else -2:]
  bt, bv = dims.tiling.block_rows, dims.tiling.block_vocab
  r0, v0 = pl.program_id(0) * bt, pl.program_id(1) * bv
  rows = _row_loads(row_refs)

  @pl.when(_active(rows.g, rows.g_lse))
  def _():
    ds, row_ok, col_ok = _logit_grad(x_ref, 0, w_ref, b_ref, r0, v0, rows, dims, options)
    terms = operand_terms(ds, x_ref.dtype)
    if db_ref:
      pallas.atomic_add(db_ref[0], (pl.ds(v0, bv),), ds.sum(axis=0))

    @pl.loop(0, dims.hidden_chunks)
    def _(c):
      h, h_ok = _hidden_chunk(c, dims)
      x = pallas.load(x_ref.at[:, h], mask=row_ok[:, None] & h_ok[None, :], other=0)
      w = pallas.load(w_ref.at[h, pl.ds(v0, bv)], mask=h_ok[:, None] & col_ok[None, :],
                      other=0)
      # The accumulators are padded to whole tiles, where the masked loads and ds add 0:
      # the adds need no mask.
      pallas.atomic_add(dx_ref, (pl.ds(r0, bt), h),
                        sum_products(terms, lambda d: pallas.dot(d, w, trans_b=True)))
      pallas.atomic_add(dw_ref, (h, pl.ds(v0, bv)),
                        sum_products(terms, lambda d: pallas.dot(x, d, trans_a=True)))

def _zero_chunks(ref, dims: Dims, axis: int):
  """Zeroes a program's (rows x hidden) or (hidden x vocabulary) block one hidden-dim
  chunk at a time: a whole block is too large for one register tile."""
  bh = dims.tiling.block_hidden
  shape = list(ref.shape)
  shape[axis] = bh

  @pl.loop(0, dims.hidden_chunks)
  def _(c):
    index = [slice(None)] * 2
    index[axis] = pl.ds(c * bh, bh)
    ref[tuple(index)] = jnp.zeros(shape, jnp.float32)

def _dx_kernel(x_ref, w_ref, *refs, dims: Dims, options: Options):
  """Deterministic backward, dhidden: one program per block of rows, walking every
  vocabulary tile; it owns its rows of dhidden."""
  b_ref = refs[0] if options.has_bias else None
  row_refs = refs[1 if options.has_bias else 0:][:len(Rows._fields)]
  dx_ref = refs[-1]
  bt, bv = dims.tiling.block_rows, dims.tiling.block_vocab
  r0 = pl.program_id(0) * bt
  rows = _row_loads(row_refs)
  _zero_chunks(dx_ref, dims, axis=1)

  @pl.when(_active(rows.g, rows.g_lse))
  def _():
    @pl.loop(0, dims.vocab_tiles)
    def _(j):
      ds, _, col_ok = _logit_grad(x_ref, 0, w_ref, b_ref, r0, j * bv, rows, dims, options)
      terms = operand_terms(ds, x_ref.dtype)

      @pl.loop(0, dims.hidden_chunks)
      def _(c):
        h, h_ok = _hidden_chunk(c, dims)
        w = pallas.load(w_ref.at[h, pl.ds(j * bv, bv)],
                        mask=h_ok[:, None] & col_ok[None, :], other=0)
        dx_ref[:, h] = dx_ref[:, h] + sum_products(
            terms, lambda d: pallas.dot(d, w, trans_b=True))

def _dw_kernel(x_ref, w_ref, *refs, dims: Dims, options: Options):
  """Deterministic backward, dweight and dbias: one program per vocabulary tile, walking
  every block of rows; it owns its columns of dweight and dbias."""
  b_ref = refs[0] if options.has_bias else None
  row_refs = refs[1 if options.has_bias else 0:][:len(Rows._fields)]
  dw_ref, *db_ref = refs[-2 if options.has_bias else -1:]
  bt, bv = dims.tiling.block_rows, dims.tiling.block_vocab
  v0 = pl.program_id(0) * bv
  _zero_chunks(dw_ref, dims, axis=0)
  if db_ref:
    db_ref[0][...] = jnp.zeros(db_ref[0].shape, jnp.float32)

  @pl.loop(0, dims.row_blocks)
  def _(i):
    r0 = i * bt
    rows = _row_loads(row_refs, r0, bt)

    @pl.when(_active(rows.g, rows.g_lse))
    def _():
      ds, row_ok, _ = _logit_grad(x_ref, r0, w_ref, b_ref, r0, v0, rows, dims, options)
      terms = operand_terms(ds, x_ref.dtype)
      if db_ref:
        db_ref[0][...] = db_ref[0][...] + ds.sum(axis=0)

      @pl.loop(0, dims.hidden_chunks)
      def _(c):
        h, h_ok = _hidden_chunk(c, dims)
        x = pallas.load(x_ref.at[pl.ds(r0, bt), h], mask=row_ok[:, None] & h_ok[None, :],
                        other=0)
        dw_ref[h, :] = dw_ref[h, :] + sum_products(
            terms, lambda d: pallas.dot(x, d, trans_a=True))


def backward(x, w, b, rows: Rows, dims: Dims, options: Options, *, atomic: bool):
  """float32 (dx, dw, db or None) from the "atomic" or "two_kernels" Pallas kernels."""
  # The kernels form ds in registers: in float16 the cotangents are scaled instead (ds
  # is linear in them), leaving room for |ds / g| up to 2^8.
  scale = 1.0
  if x.dtype == jnp.float16:
    scale = power_of_two_scale(
        jnp.maximum(jnp.max(jnp.abs(rows.g)), jnp.max(jnp.abs(rows.g_lse))), F16_TOP - 8)
    rows = rows._replace(g=rows.g * scale, g_lse=rows.g_lse * scale)
  dx, dw, db = _backward_kernels(x, w, b, rows, dims, options, atomic=atomic)
  return dx / scale, dw / scale, None if db is None else db / scale


def _backward_kernels(x, w, b, rows: Rows, dims: Dims, options: Options, *,
                      atomic: bool):
  """float32 (dx, dw, db or None) from the "atomic" or "two_kernels" Pallas kernels."""
  t = dims.tiling
  R_pad = dims.row_blocks * t.block_rows
  H_pad = dims.hidden_chunks * t.block_hidden
  V_pad = dims.vocab_tiles * t.block_vocab
  pad_rows = lambda a: jnp.pad(a, (0, R_pad - dims.R))
  args = [x, w, *([b] if options.has_bias else []), *map(pad_rows, rows)]
  padded = [(R_pad, H_pad), (H_pad, V_pad)] + ([(V_pad,)] if options.has_bias else [])
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  common = dict(num_warps=t.num_warps, num_stages=t.num_stages, interpret=options.interpret)
  statics = dict(dims=dims, options=options)
  whole = lambda shape: pl.BlockSpec(shape, lambda *i: (0,) * len(shape))  # any grid

  def specs(index, rows_block: bool):
    """BlockSpecs of x, w, bias and the `Rows` vectors."""
    x_spec = (pl.BlockSpec((t.block_rows, H_pad), lambda *i: (index(*i), 0)) if rows_block
              else whole((R_pad, H_pad)))
    row = (pl.BlockSpec((t.block_rows,), lambda *i: (index(*i),)) if rows_block
           else whole((R_pad,)))
    return [x_spec, whole((H_pad, V_pad)), *([whole((V_pad,))] if options.has_bias else []),
            *[row] * len(Rows._fields)]

  if atomic:
    # The float32 accumulators (padded to whole tiles), zeroed and updated in place.
    dx, dw, *db = pallas.pallas_call(
        functools.partial(_atomic_kernel, **statics), name="linear_cross_entropy_backward",
        grid=(dims.row_blocks, dims.vocab_tiles),
        in_specs=specs(lambda i, j: i, True) + [whole(p) for p in padded],
        out_specs=[whole(p) for p in padded], out_shape=[f32(p) for p in padded],
        input_output_aliases={len(args) + k: k for k in range(len(padded))}, **common,
    )(*args, *(jnp.zeros(p, jnp.float32) for p in padded))
  else:
    dx = pallas.pallas_call(
        functools.partial(_dx_kernel, **statics), name="linear_cross_entropy_backward_dx",
        grid=(dims.row_blocks,), in_specs=specs(lambda i: i, True),
        out_specs=pl.BlockSpec((t.block_rows, H_pad), lambda i: (i, 0)),
        out_shape=f32(padded[0]), **common,
    )(*args)
    dw, *db = pallas.pallas_call(
        functools.partial(_dw_kernel, **statics), name="linear_cross_entropy_backward_dw",
        grid=(dims.vocab_tiles,), in_specs=specs(lambda j: 0, False),
        out_specs=[pl.BlockSpec((H_pad, t.block_vocab), lambda j: (0, j)),
                   *([pl.BlockSpec((t.block_vocab,), lambda j: (j,))]
                     if options.has_bias else [])],
        out_shape=[f32(p) for p in padded[1:]], **common,
    )(*args)
  return dx[:dims.R, :dims.H], dw[:dims.H, :dims.V], db[0][:dims.V] if db else None
