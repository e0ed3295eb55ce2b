"""The Triton backend of the linear cross-entropy (``implementation="triton"``): its
forward kernel, one program per block of rows and range of the vocabulary, the
online-softmax state of each logit tile folded in registers (`api`'s docstring). Any
floating dtype, and interpret mode's default; its backward is the chunked one with
XLA's ds (`chunked`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax._core.state import safe_shift
from jaxsoftmax.linear_cross_entropy.call import Call, ChunkDs
from jaxsoftmax.linear_cross_entropy.logits import LOG2E, Options, Rows, capped, merged_state
from jaxsoftmax.linear_cross_entropy.tiling import Dims

__all__ = ["NAME", "STATE_FROM_XLA", "unsupported", "forward", "chunk_ds"]

NAME = "triton"
STATE_FROM_XLA = False


def unsupported(call: Call) -> str | None:
  """Why the Triton forward does not take ``call`` by default: compiled float32 products,
  which Triton runs as IEEE FMAs off the tensor cores (`pallas.dot`), at about 3 TFLOP/s
  on the H200 (docs/kernels.md, "Linear cross-entropy"). Named, or interpreted, it takes
  every call."""
  if call.dtype == "float32" and not (call.named or call.interpret):
    return ("its float32 products run as IEEE FMAs off the tensor cores, slower than "
            "XLA's (the xla_chunks backend takes float32)")
  return None


def chunk_ds(x, rows: Rows, call: Call) -> ChunkDs | None:
  """None: the chunked backward forms ds in XLA."""
  del x, rows, call
  return None


def _logit_tile(x_ref, w_ref, b_ref, r0, v0, dims: Dims, options: Options):
  """(s, column indices, column mask) of the float32 logit tile of the block of rows
  [r0, r0 + block_rows) that ``x_ref`` holds and of the columns [v0, v0 + block_vocab)
  (``w_ref``, ``b_ref``: whole)."""
  t = dims.tiling
  bt, bv, bh = t.block_rows, t.block_vocab, t.block_hidden
  rows = r0 + jnp.arange(bt, dtype=jnp.int32)
  cols = v0 + jnp.arange(bv, dtype=jnp.int32)
  row_ok, col_ok = rows < dims.R, cols < dims.V

  def chunk(c, z):
    h = c * bh + jnp.arange(bh, dtype=jnp.int32)
    h_ok = h < dims.H
    x = pallas.load(x_ref.at[pl.ds(0, bt), pl.ds(c * bh, bh)],
                    mask=row_ok[:, None] & h_ok[None, :], other=0)
    w = pallas.load(w_ref.at[pl.ds(c * bh, bh), pl.ds(v0, bv)],
                    mask=h_ok[:, None] & col_ok[None, :], other=0)
    return z + pallas.dot(x, w)

  z = lax.fori_loop(0, dims.hidden_chunks, chunk, jnp.zeros((bt, bv), jnp.float32))
  if options.has_bias:
    z = z + pallas.load(b_ref.at[pl.ds(v0, bv)], mask=col_ok, other=0).astype(
        jnp.float32)[None, :]
  return capped(z, options)[0], cols, col_ok

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
    s, cols, col_ok = _logit_tile(x_ref, w_ref, b_ref, r0, (first + k) * bv, dims, options)
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


def forward(x, w, b, labels, call: Call):
  """The Triton forward: per row, float32 (R,), the softmax state as its shift m and log
  l (`Rows`; lse = m + log l), the label's logit s_y and Σ_j s_j."""
  dims, options = call.dims, call.options
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
