"""Linear layer + softmax cross-entropy in Pallas kernels that never write the logits.

For rows x (R, H) of ``hidden``, ``weight`` W (H, V) and optional ``bias`` b, the logits
z = x W + b (float32 accumulation) become s = c·tanh(z / c) under a soft cap c (Gemma 2),
else s = z; with the row's lse = log Σ_j exp(s_j), label y, smoothing a and z-loss
coefficient ζ, the loss is that of `jaxsoftmax.cross_entropy` on s:

    loss = lse - (1 - a)·s_y - a·mean_j s_j + ζ·lse²

Forward kernel: one program per (block of rows, range of the vocabulary). It walks the
range in vocabulary tiles; each logit tile is a sum over hidden-dim chunks of
x-chunk · W-chunk products on the tensor cores, and never leaves registers: the program
keeps the online-softmax state (m, l), the label's logit and Σ s_j per row, and writes
those four numbers per row for its range. The ranges merge in float32 (the
`merge_states` rule), so nothing R x V reaches memory.

Backward: the gradient with respect to the logits is

    ds = g·[(1 + 2ζ·lse)·p - (1 - a)·[j = y] - a / V] + g_lse·p,   p = exp(s - lse)

(times 1 - (s/c)² under a soft cap), then dhidden = ds · Wᵀ, dweight = xᵀ · ds and
dbias = Σ_rows ds. p is formed as exp((s - m) - log l) from the forward's merged state,
not from lse = m + log l, whose float32 rounding would cost p up to half an ulp of lse
(the forward saves both). Three ways, ``LinearCrossEntropyTiling.backward``:

- "chunked" (the default): the vocabulary in chunks of ``chunk_vocab`` columns; per
  chunk, XLA's matrix products (cuBLAS on a GPU) recompute its logits in float32 and
  form its dweight columns (complete: every row contributes) and its share of a float32
  dhidden, with ds formed in between and rounded to the inputs' dtype. A T x chunk
  block of logits and of ds is the only buffer beyond the gradients and the float32
  dhidden. Deterministic. For bfloat16 without a bias on a Hopper GPU (by default, or
  ``dlogits="mosaic_gpu"``) one Pallas Mosaic GPU kernel forms each chunk's ds instead:
  the forward's products, ds in their epilogue, written in bfloat16
  (`mosaic_gpu.dlogits`), with no float32 logits between them.
- "atomic": one Pallas kernel per (block of rows, vocabulary tile) recomputes its logit
  tile and forms ds in registers, then adds ds · Wᵀ, xᵀ · ds and Σ_rows ds into float32
  accumulators with atomic adds (Cut Cross-Entropy's scheme, Wijmans et al. 2024).
- "two_kernels": a dhidden kernel over blocks of rows and a dweight kernel over
  vocabulary tiles, each recomputing the logit tiles and owning what it writes.

On the H200 the two kernel variants measured 6-8x slower than XLA's unfused loss (their
updates of the float32 accumulators in global memory, per tile, dominate); "chunked"
spends its time in the vendor's matrix products instead. ds enters every product in the
inputs' dtype (in float16 scaled and as two terms, `_operand_terms`).

The forward has two kernels, ``LinearCrossEntropyTiling.forward``: the Triton one above
(the default off Hopper GPUs and for float32, and the one interpret mode runs by
default) and a Hopper one in Pallas Mosaic GPU (`mosaic_gpu`: wgmma products fed by TMA
from a warp-specialized producer, the online-softmax update as their epilogue; the
label's logit and, without a soft cap, Σ_j s come from XLA beside it). On a Hopper GPU
it is the default for bfloat16 and float16: on the H200 it ran at 1.04x-1.08x the time
of cuBLAS's bfloat16 product alone, 1.42x-1.48x faster than the Triton kernel
(`benchmarks/results/README.md`).

FLOPs: forward 2·R·H·V; backward 6·R·H·V (logits again, dhidden, dweight), 8·R·H·V with
two kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax import _backend, reference
from jaxsoftmax._backend import pl
from jaxsoftmax._backend import mosaic_gpu as mosaic_device
from jaxsoftmax.cross_entropy import REDUCTIONS, check_labels, reduce_losses
from jaxsoftmax.inputs import check_floating, check_optional_positive_int
from jaxsoftmax.linear_map import LinearMap
from jaxsoftmax.state import reduce_states, safe_shift
from jaxsoftmax.linear_cross_entropy import mosaic_gpu
from jaxsoftmax.linear_cross_entropy.mosaic_gpu import LinearCrossEntropyHopperTiling

__all__ = ["linear_cross_entropy", "LinearCrossEntropyTiling",
           "LinearCrossEntropyHopperTiling"]

_BACKWARDS = ("chunked", "atomic", "two_kernels")
_FORWARDS = ("triton", "mosaic_gpu")
_DLOGITS = ("xla", "mosaic_gpu")
# The chunked backward's default chunk: about this many logits (64 MiB in float32).
_CHUNK_LOGITS = 1 << 24
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyTiling:
  """Tiles of the fused kernels.

  Attributes:
    block_rows: rows of hidden per program.
    block_vocab: vocabulary columns per logit tile.
    block_hidden: hidden-dim chunk of each tile product.
    vocab_splits: vocabulary ranges of the forward (programs per block of rows); None
      picks enough programs to fill the GPU.
    num_warps, num_stages: Triton launch parameters.
    backward: "chunked" (XLA's matrix products over vocabulary chunks), "atomic" (one
      kernel; float32 atomic adds, run-to-run differences in the last bits) or
      "two_kernels" (a dhidden kernel over blocks of rows and a dweight kernel over
      vocabulary tiles, each recomputing the logits); None: "chunked" for 16-bit
      inputs, "two_kernels" for float32 (see `_backward_chunked`).
    chunk_vocab: vocabulary columns per chunk of the chunked backward; None picks about
      2**24 logits per chunk (a power of two, at least 1024 columns).
    forward: the forward's kernel: "triton" (the tiles above) or "mosaic_gpu" (a Hopper
      GPU's tensor cores through Pallas Mosaic GPU, bfloat16 and float16 only;
      interpreted by Pallas' Mosaic GPU interpreter off a GPU; its tiles are
      ``hopper``); None: "mosaic_gpu" where it can run (16-bit inputs on a Hopper GPU,
      not interpreted), else "triton".
    hopper: the "mosaic_gpu" forward's `LinearCrossEntropyHopperTiling`; None: its
      defaults.
    dlogits: how the chunked backward forms a chunk's ds: "xla" (XLA's product writes
      the float32 logits, then an elementwise pass rounds ds to the inputs' dtype) or
      "mosaic_gpu" (one Hopper kernel, `mosaic_gpu.dlogits`: the forward's products with
      ds formed in their epilogue and written in bfloat16; bfloat16 inputs without a
      bias, chunks a multiple of ``hopper.block_vocab``); None: "mosaic_gpu" where it
      can run (not interpreted), else "xla".
  """

  block_rows: int = 64
  block_vocab: int = 128
  block_hidden: int = 64
  vocab_splits: int | None = None
  num_warps: int = 4
  num_stages: int = 2
  backward: str | None = None
  chunk_vocab: int | None = None
  forward: str | None = None
  hopper: LinearCrossEntropyHopperTiling | None = None
  dlogits: str | None = None

  @property
  def hopper_tiling(self) -> LinearCrossEntropyHopperTiling:
    """The "mosaic_gpu" forward's tiles: ``hopper``, or their defaults."""
    return self.hopper or LinearCrossEntropyHopperTiling()

  def __post_init__(self):
    for name in ("block_rows", "block_vocab", "block_hidden"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= 16 and value & (value - 1) == 0):
        raise ValueError(f"LinearCrossEntropyTiling.{name} must be a power of two >= 16, "
                         f"got {value!r}")
    if self.backward is not None and self.backward not in _BACKWARDS:
      raise ValueError(f"LinearCrossEntropyTiling.backward must be one of {_BACKWARDS}, "
                       f"got {self.backward!r}")
    if self.forward is not None and self.forward not in _FORWARDS:
      raise ValueError(f"LinearCrossEntropyTiling.forward must be one of {_FORWARDS}, "
                       f"got {self.forward!r}")
    if self.dlogits is not None and self.dlogits not in _DLOGITS:
      raise ValueError(f"LinearCrossEntropyTiling.dlogits must be one of {_DLOGITS}, "
                       f"got {self.dlogits!r}")
    if self.hopper is not None and not isinstance(self.hopper,
                                                  LinearCrossEntropyHopperTiling):
      raise TypeError("LinearCrossEntropyTiling.hopper must be a "
                      f"LinearCrossEntropyHopperTiling or None, got {self.hopper!r}")
    for name in ("chunk_vocab", "vocab_splits"):
      check_optional_positive_int(getattr(self, name), f"LinearCrossEntropyTiling.{name}")


@dataclasses.dataclass(frozen=True)
class _Dims:
  R: int  # rows
  H: int
  V: int
  tiling: LinearCrossEntropyTiling

  @property
  def row_blocks(self) -> int:
    return pl.cdiv(self.R, self.tiling.block_rows)

  @property
  def vocab_tiles(self) -> int:
    return pl.cdiv(self.V, self.tiling.block_vocab)

  @property
  def hidden_chunks(self) -> int:
    return pl.cdiv(self.H, self.tiling.block_hidden)

  @property
  def chunk(self) -> int:
    """Vocabulary columns per chunk of the chunked backward."""
    if self.tiling.chunk_vocab is not None:
      return min(self.tiling.chunk_vocab, self.V)
    columns = 1 << max(10, (_CHUNK_LOGITS // self.R).bit_length() - 1)
    return min(columns, self.V)

  def splits(self) -> tuple[int, int]:
    """(vocabulary ranges, tiles per range) of the forward; every range holds a tile."""
    wanted = self.tiling.vocab_splits
    if wanted is None:  # two programs per SM
      wanted = pl.cdiv(2 * _backend.num_cores(), self.row_blocks)
    return _backend.even_groups(self.vocab_tiles, wanted)


@dataclasses.dataclass(frozen=True)
class _Options:
  label_smoothing: float
  z_loss: float
  softcap: float | None
  has_bias: bool
  interpret: bool


def _logit_tile(x_ref, x_row0, w_ref, b_ref, r0, v0, dims: _Dims, options: _Options):
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
    x = _backend.load(x_ref.at[pl.ds(x_row0, bt), pl.ds(c * bh, bh)],
                      mask=row_ok[:, None] & h_ok[None, :], other=0)
    w = _backend.load(w_ref.at[pl.ds(c * bh, bh), pl.ds(v0, bv)],
                      mask=h_ok[:, None] & col_ok[None, :], other=0)
    return z + _backend.dot(x, w)

  z = lax.fori_loop(0, dims.hidden_chunks, chunk, jnp.zeros((bt, bv), jnp.float32))
  if options.has_bias:
    z = z + _backend.load(b_ref.at[pl.ds(v0, bv)], mask=col_ok, other=0).astype(
        jnp.float32)[None, :]
  return (*_capped(z, options), cols, col_ok, row_ok)


def _capped(z, options: _Options):
  """(s, ds/dz or None): the logits s after the soft cap, s = c·tanh(z / c)."""
  if options.softcap is None:
    return z, None
  t = jnp.tanh(z / options.softcap)
  return options.softcap * t, 1.0 - t * t


def _forward_kernel(x_ref, w_ref, *refs, dims: _Dims, options: _Options, per: int):
  b_ref = refs[0] if options.has_bias else None
  y_ref, m_ref, l_ref, label_ref, sum_ref = refs[1 if options.has_bias else 0:]
  bt, bv = dims.tiling.block_rows, dims.tiling.block_vocab
  r0 = pl.program_id(0) * bt
  first = pl.program_id(1) * per
  tiles = jnp.minimum(per, dims.vocab_tiles - first)  # the last range may be shorter
  exp2 = _backend.exp2(options.interpret)
  labels = y_ref[...]

  def tile(k, carry):
    m, l, label, total = carry
    s, _, cols, col_ok, _ = _logit_tile(x_ref, 0, w_ref, b_ref, r0, (first + k) * bv, dims,
                                        options)
    s_in = jnp.where(col_ok[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, s_in.max(axis=1))
    # l is relative to safe_shift(m) (state.py), so a +inf logit gives l = +inf and
    # lse = +inf, as jax.nn.logsumexp does; the empty state's l = 0 stays 0 however far
    # the shift moves.
    shift = safe_shift(m_new)
    scaled = jnp.where(l > 0, l * exp2((safe_shift(m) - shift) * _LOG2E), l)
    l = scaled + exp2((s_in - shift[:, None]) * _LOG2E).sum(axis=1)
    label = label + jnp.where(cols[None, :] == labels[:, None], s, 0.0).sum(axis=1)
    total = total + jnp.where(col_ok[None, :], s, 0.0).sum(axis=1)
    return m_new, l, label, total

  zeros = jnp.zeros((bt,), jnp.float32)
  m, l, label, total = lax.fori_loop(0, tiles, tile,
                                     (jnp.full((bt,), -jnp.inf, jnp.float32), zeros,
                                      zeros, zeros))
  m_ref[...], l_ref[...], label_ref[...], sum_ref[...] = m, l, label, total


def _forward(x, w, b, labels, dims: _Dims, options: _Options):
  """Per row, float32 (R,): the softmax state as its shift m and log l (`_Rows`; lse =
  m + log l), the label's logit s_y and Σ_j s_j."""
  if dims.tiling.forward == "mosaic_gpu":
    return _forward_hopper(x, w, b, labels, dims, options)
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
  m, l, label, total = _backend.pallas_call(
      functools.partial(_forward_kernel, dims=dims, options=options, per=per),
      name="linear_cross_entropy_forward", grid=(dims.row_blocks, splits),
      in_specs=in_specs, out_specs=[stat] * 4, out_shape=[stat_shape] * 4,
      num_warps=t.num_warps, num_stages=t.num_stages, interpret=options.interpret,
  )(*args, jnp.pad(labels, (0, R_pad - dims.R)))
  m, log_l = _shift_and_log_l(m, l)
  return m[:dims.R], log_l[:dims.R], label.sum(axis=0)[:dims.R], total.sum(axis=0)[:dims.R]


def _shift_and_log_l(m, l):
  """The ranges' states (m, l), stacked on axis 0, merged: (safe_shift(m), log l)."""
  m, l = reduce_states(m, l, axis=0)
  return safe_shift(m), jnp.log(l)


def _forward_hopper(x, w, b, labels, dims: _Dims, options: _Options):
  """`_forward` by the Hopper kernel (`mosaic_gpu`): the state from its ranges' states;
  the label's logit, and Σ_j s without a soft cap, from XLA's products beside it."""
  with_total = options.softcap is not None and options.label_smoothing > 0
  m, l, total = mosaic_gpu.forward(x, w, b, tiling=dims.tiling.hopper_tiling,
                                   softcap=options.softcap, with_total=with_total,
                                   interpret=options.interpret)
  m, log_l = _shift_and_log_l(m, l)
  # s_y = cap(x_r · W[:, y_r] + b_y); an out-of-range label's row is NaN in `_loss`.
  y = jnp.clip(labels, 0, dims.V - 1)
  z_y = jnp.einsum("rh,hr->r", x, jnp.take(w, y, axis=1),
                   preferred_element_type=jnp.float32)
  if b is not None:
    z_y = z_y + b[y].astype(jnp.float32)
  s_y = _capped(z_y, options)[0]
  if with_total:
    total = total.sum(axis=0)
  elif options.label_smoothing > 0:  # Σ_j z_j = x · (W 1) + Σ_j b_j
    total = jnp.dot(x, jnp.sum(w, axis=1, dtype=jnp.float32).astype(x.dtype),
                    preferred_element_type=jnp.float32)
    if b is not None:
      total = total + jnp.sum(b, dtype=jnp.float32)
  else:
    total = jnp.zeros_like(m)
  return m, log_l, s_y, total


class _Rows(NamedTuple):
  """The backward's values of each row: its label; the forward's softmax state as its
  shift m (the finite row maximum, `state.safe_shift`) and log l, so that p =
  exp((s - m) - log l) stays exact in float32 where s is near m (through an lse rounded
  to float32, p would be off by up to half its ulp: 5e-4 at |lse| ~ 1e4); and the
  cotangents g of the loss and g_lse of the returned lse."""

  labels: jax.Array
  m: jax.Array
  log_l: jax.Array
  g: jax.Array
  g_lse: jax.Array

  @property
  def lse(self):
    return self.m + self.log_l


def _probabilities(s, rows: _Rows, exp):
  """p = exp((s - m) - log l) of a block of logits s (rows x columns)."""
  return exp((s - rows.m[:, None]) - rows.log_l[:, None])


def _logit_grad(x_ref, x_row0, w_ref, b_ref, r0, v0, rows: _Rows, dims: _Dims,
                options: _Options):
  """(ds, row mask, column mask): the float32 gradient of the loss with respect to the
  tile's logits z, for the `_Rows` of its rows."""
  s, dsdz, cols, col_ok, row_ok = _logit_tile(x_ref, x_row0, w_ref, b_ref, r0, v0, dims,
                                              options)
  exp2 = _backend.exp2(options.interpret)
  p = jnp.where(row_ok[:, None] & col_ok[None, :],
                _probabilities(s, rows, lambda t: exp2(t * _LOG2E)), 0.0)
  return _dlogits(p, dsdz, cols, col_ok, rows, dims, options), row_ok, col_ok


def p_coefficient(g, g_lse, lse, z_loss: float):
  """The factor of p in ds, g·(1 + 2ζ·lse) + g_lse; without a z-loss g + g_lse, so that
  an infinite lse (a +inf logit) does not make 0·inf = NaN of every ds in its row."""
  return (g * (1 + 2 * z_loss * lse) if z_loss else g) + g_lse


def _dlogits(p, dsdz, cols, col_ok, rows: _Rows, dims: _Dims, options: _Options):
  """ds of a block of logits (see the module docstring) from their probabilities p (0
  where masked), ds/dz (None without a soft cap), column indices and which of them lie
  in the vocabulary (None: all), for the `_Rows` of its rows."""
  labels, g = rows.labels, rows.g
  a = options.label_smoothing
  ds = p_coefficient(g, rows.g_lse, rows.lse, options.z_loss)[:, None] * p
  ds = ds - jnp.where(cols[None, :] == labels[:, None], (g * (1 - a))[:, None], 0.0)
  if a:
    smoothing = (g * (a / dims.V))[:, None]
    ds = ds - (smoothing if col_ok is None else jnp.where(col_ok[None, :], smoothing, 0.0))
  return ds if dsdz is None else ds * dsdz


def _operand_terms(ds, dtype):
  """ds as the tensor cores' operands: ds rounded to the inputs' dtype, and in float16
  also the rounding remainder as a second term. float16's 11 bits on ds put dhidden at
  2.5x a float16 reference's error (which keeps ds in float32); the remainder brings it
  to float32 accuracy for one more product, as the Triton attention backward does for
  dS. bfloat16 takes one term: it keeps dhidden within the 2x rule on the tests' shapes
  and the H200 runs', but not everywhere a small H leaves few products to average the
  rounding (3.3x a bfloat16 reference's error at H = 64, soft cap 4, 340 rows); a
  second term would cost one more product a chunk."""
  high = ds.astype(dtype)
  if dtype != jnp.float16:
    return (high,)
  return high, (ds - high.astype(jnp.float32)).astype(dtype)


# float16 ds is scaled by a power of two that brings its largest magnitude to about
# 2^_F16_TOP: a mean over many rows makes ds as small as 1e-8 (g = 1/rows times
# probabilities over a large vocabulary), below float16's smallest normal number (6e-5),
# where its rounding keeps no digits (on the H200: dhidden at 32x a float16 reference's
# error, 256 rows, V = 256000). A power of two rescales exactly, and 2^14 keeps the
# float16 operands below their largest value (65504). bfloat16 has float32's exponent
# range and needs no scale.
_F16_TOP = 14


def _power_of_two_scale(largest, top: int):
  """2^k with largest · 2^k in (2^(top - 1), 2^top], or 1 for a largest of 0 or NaN."""
  ok = jnp.isfinite(largest) & (largest > 0)
  return jnp.exp2(jnp.where(ok, top - jnp.ceil(jnp.log2(jnp.where(ok, largest, 1.0))), 0.0))


def _scaled_terms(ds, dtype):
  """(terms, unscale): `_operand_terms` of ds, scaled in float16 (see _F16_TOP), and
  the factor that takes the products back."""
  if dtype != jnp.float16:
    return _operand_terms(ds, dtype), 1.0
  scale = _power_of_two_scale(jnp.max(jnp.abs(ds)), _F16_TOP)
  return _operand_terms(ds * scale, dtype), 1.0 / scale


def _sum_products(terms, product):
  """Σ product(term) over the operand terms of ds."""
  out = product(terms[0])
  for term in terms[1:]:
    out = out + product(term)
  return out


def _row_loads(refs, r0=None, rows=None) -> _Rows:
  """The `_Rows` of a block of rows: whole refs (``r0`` None) or row blocks."""
  if r0 is None:
    return _Rows(*(ref[...] for ref in refs))
  return _Rows(*(ref[pl.ds(r0, rows)] for ref in refs))


def _active(g, g_lse):
  """Whether a block of rows has a cotangent (blocks of ignored rows are skipped). A count,
  not jnp.any: Pallas' Triton lowering has no boolean reduction; NaN counts (!= 0)."""
  return jnp.sum((g != 0).astype(jnp.int32) + (g_lse != 0).astype(jnp.int32)) > 0


def _hidden_chunk(c, dims: _Dims):
  """Columns [c·block_hidden, ...) of the hidden dim and which lie inside it."""
  bh = dims.tiling.block_hidden
  return pl.ds(c * bh, bh), c * bh + jnp.arange(bh, dtype=jnp.int32) < dims.H


def _atomic_kernel(x_ref, w_ref, *refs, dims: _Dims, options: _Options):
  """One program per (block of rows, vocabulary tile): its products go to dhidden,
  dweight and dbias by float32 atomic adds."""
  b_ref = refs[0] if options.has_bias else None
  row_refs = refs[1 if options.has_bias else 0:][:len(_Rows._fields)]
  dx_ref, dw_ref, *db_ref = refs[-3 if options.has_bias else -2:]
  bt, bv = dims.tiling.block_rows, dims.tiling.block_vocab
  r0, v0 = pl.program_id(0) * bt, pl.program_id(1) * bv
  rows = _row_loads(row_refs)

  @pl.when(_active(rows.g, rows.g_lse))
  def _():
    ds, row_ok, col_ok = _logit_grad(x_ref, 0, w_ref, b_ref, r0, v0, rows, dims, options)
    terms = _operand_terms(ds, x_ref.dtype)
    if db_ref:
      _backend.atomic_add(db_ref[0], (pl.ds(v0, bv),), ds.sum(axis=0))

    @pl.loop(0, dims.hidden_chunks)
    def _(c):
      h, h_ok = _hidden_chunk(c, dims)
      x = _backend.load(x_ref.at[:, h], mask=row_ok[:, None] & h_ok[None, :], other=0)
      w = _backend.load(w_ref.at[h, pl.ds(v0, bv)], mask=h_ok[:, None] & col_ok[None, :],
                        other=0)
      # The accumulators are padded to whole tiles, where the masked loads and ds add 0:
      # the adds need no mask.
      _backend.atomic_add(dx_ref, (pl.ds(r0, bt), h),
                          _sum_products(terms, lambda d: _backend.dot(d, w, trans_b=True)))
      _backend.atomic_add(dw_ref, (h, pl.ds(v0, bv)),
                          _sum_products(terms, lambda d: _backend.dot(x, d, trans_a=True)))


def _zero_chunks(ref, dims: _Dims, axis: int):
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


def _dx_kernel(x_ref, w_ref, *refs, dims: _Dims, options: _Options):
  """Deterministic backward, dhidden: one program per block of rows, walking every
  vocabulary tile; it owns its rows of dhidden."""
  b_ref = refs[0] if options.has_bias else None
  row_refs = refs[1 if options.has_bias else 0:][:len(_Rows._fields)]
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
      terms = _operand_terms(ds, x_ref.dtype)

      @pl.loop(0, dims.hidden_chunks)
      def _(c):
        h, h_ok = _hidden_chunk(c, dims)
        w = _backend.load(w_ref.at[h, pl.ds(j * bv, bv)],
                          mask=h_ok[:, None] & col_ok[None, :], other=0)
        dx_ref[:, h] = dx_ref[:, h] + _sum_products(
            terms, lambda d: _backend.dot(d, w, trans_b=True))


def _dw_kernel(x_ref, w_ref, *refs, dims: _Dims, options: _Options):
  """Deterministic backward, dweight and dbias: one program per vocabulary tile, walking
  every block of rows; it owns its columns of dweight and dbias."""
  b_ref = refs[0] if options.has_bias else None
  row_refs = refs[1 if options.has_bias else 0:][:len(_Rows._fields)]
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
      terms = _operand_terms(ds, x_ref.dtype)
      if db_ref:
        db_ref[0][...] = db_ref[0][...] + ds.sum(axis=0)

      @pl.loop(0, dims.hidden_chunks)
      def _(c):
        h, h_ok = _hidden_chunk(c, dims)
        x = _backend.load(x_ref.at[pl.ds(r0, bt), h], mask=row_ok[:, None] & h_ok[None, :],
                          other=0)
        dw_ref[h, :] = dw_ref[h, :] + _sum_products(
            terms, lambda d: _backend.dot(x, d, trans_a=True))


def _logit_grad_chunk(z, start, rows, dims: _Dims, options: _Options):
  """ds (rows, chunk) in float32 for the logits z = x W + b of the columns
  [start, start + chunk); `_logit_grad` for a whole chunk, in XLA."""
  s, dsdz = _capped(z, options)
  cols = start + jnp.arange(z.shape[1], dtype=jnp.int32)
  return _dlogits(_probabilities(s, rows, jnp.exp), dsdz, cols, None, rows, dims, options)


def _backward_chunked(x, w, b, rows: _Rows, dims: _Dims, options: _Options):
  """(dx float32, dw in w's dtype, db float32 or None) over vocabulary chunks. The last
  chunk ends at V; where V is not a multiple of the chunk it overlaps the one before,
  whose columns it leaves out of dx and rewrites, with the same values, in dw and db.

  Its logits are XLA's product, not the forward kernel's: the two round their float32
  sums differently, so p of a row sums to 1 only up to that difference.
  For 16-bit inputs that is far below their own rounding; for float32 inputs it put
  dhidden at 2-3x a float32 reference's error (whose softmax is normalized by its own
  sum), so float32 defaults to the "two_kernels" backward, whose logit tiles are the
  forward's."""
  chunk = dims.chunk
  n_chunks = pl.cdiv(dims.V, chunk)
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
  hopper = dims.tiling.dlogits == "mosaic_gpu"
  if hopper:
    shared = mosaic_gpu.dlogits_inputs(
        x, rows.labels, rows.m, rows.log_l, rows.g,
        p_coefficient(rows.g, rows.g_lse, rows.lse, options.z_loss), V=dims.V,
        label_smoothing=options.label_smoothing)
    operands = lambda ds: ((ds,), 1.0)  # already bfloat16, the products' operand
  else:
    operands = lambda ds: _scaled_terms(ds, x.dtype)

  def step(carry, c):
    dx, dw, db = carry
    start = jnp.minimum(c * chunk, dims.V - chunk)
    w_c = lax.dynamic_slice_in_dim(w, start, chunk, axis=1)
    if hopper:  # ds in bfloat16 from one kernel; no float32 logits in memory
      ds = mosaic_gpu.dlogits(shared, w_c, start, tiling=dims.tiling.hopper_tiling,
                              softcap=options.softcap, interpret=options.interpret)[:dims.R]
    else:
      z = dot(x, w_c)
      if b is not None:
        z = z + lax.dynamic_slice_in_dim(b, start, chunk).astype(jnp.float32)[None, :]
      ds = _logit_grad_chunk(z, start, rows, dims, options)
    terms, unscale = operands(ds)
    dw_c = _sum_products(terms, lambda d: dot(x.T, d)) * unscale
    dw = lax.dynamic_update_slice_in_dim(dw, dw_c.astype(dw.dtype), start, axis=1)
    if dims.V % chunk:  # the last chunk's columns of the chunk before stay out of dx
      new = (start + jnp.arange(chunk, dtype=jnp.int32) >= c * chunk)[None, :]
      terms, unscale = operands(jnp.where(new, ds, 0))
    dx = dx + _sum_products(terms, lambda d: dot(d, w_c.T)) * unscale
    if db is not None:
      db = lax.dynamic_update_slice_in_dim(db, ds.sum(axis=0), start, axis=0)
    return (dx, dw, db), None

  init = (jnp.zeros((dims.R, dims.H), jnp.float32), jnp.zeros(w.shape, w.dtype),
          None if b is None else jnp.zeros((dims.V,), jnp.float32))
  # The accumulators vary over the mesh axes their summands do (inside jax.shard_map).
  init = _backend.vary_over(init, _backend.varying_axes(x, w, b, rows))
  (dx, dw, db), _ = lax.scan(step, init, jnp.arange(n_chunks, dtype=jnp.int32))
  return dx, dw, db


def _backward(x, w, b, rows: _Rows, dims: _Dims, options: _Options):
  """float32 (dx, dw, db or None)."""
  t = dims.tiling
  backward = t.backward or ("two_kernels" if x.dtype == jnp.float32 else "chunked")
  if backward == "chunked":
    return _backward_chunked(x, w, b, rows, dims, options)
  # The kernels form ds in registers: in float16 the cotangents are scaled instead (ds
  # is linear in them), leaving room for |ds / g| up to 2^8.
  scale = 1.0
  if x.dtype == jnp.float16:
    scale = _power_of_two_scale(
        jnp.maximum(jnp.max(jnp.abs(rows.g)), jnp.max(jnp.abs(rows.g_lse))), _F16_TOP - 8)
    rows = rows._replace(g=rows.g * scale, g_lse=rows.g_lse * scale)
  dx, dw, db = _backward_kernels(x, w, b, rows, dims, options, atomic=backward == "atomic")
  return dx / scale, dw / scale, None if db is None else db / scale


def _backward_kernels(x, w, b, rows: _Rows, dims: _Dims, options: _Options, *,
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
    """BlockSpecs of x, w, bias and the `_Rows` vectors."""
    x_spec = (pl.BlockSpec((t.block_rows, H_pad), lambda *i: (index(*i), 0)) if rows_block
              else whole((R_pad, H_pad)))
    row = (pl.BlockSpec((t.block_rows,), lambda *i: (index(*i),)) if rows_block
           else whole((R_pad,)))
    return [x_spec, whole((H_pad, V_pad)), *([whole((V_pad,))] if options.has_bias else []),
            *[row] * len(_Rows._fields)]

  if atomic:
    # The float32 accumulators (padded to whole tiles), zeroed and updated in place.
    dx, dw, *db = _backend.pallas_call(
        functools.partial(_atomic_kernel, **statics), name="linear_cross_entropy_backward",
        grid=(dims.row_blocks, dims.vocab_tiles),
        in_specs=specs(lambda i, j: i, True) + [whole(p) for p in padded],
        out_specs=[whole(p) for p in padded], out_shape=[f32(p) for p in padded],
        input_output_aliases={len(args) + k: k for k in range(len(padded))}, **common,
    )(*args, *(jnp.zeros(p, jnp.float32) for p in padded))
  else:
    dx = _backend.pallas_call(
        functools.partial(_dx_kernel, **statics), name="linear_cross_entropy_backward_dx",
        grid=(dims.row_blocks,), in_specs=specs(lambda i: i, True),
        out_specs=pl.BlockSpec((t.block_rows, H_pad), lambda i: (i, 0)),
        out_shape=f32(padded[0]), **common,
    )(*args)
    dw, *db = _backend.pallas_call(
        functools.partial(_dw_kernel, **statics), name="linear_cross_entropy_backward_dw",
        grid=(dims.vocab_tiles,), in_specs=specs(lambda j: 0, False),
        out_specs=[pl.BlockSpec((H_pad, t.block_vocab), lambda j: (0, j)),
                   *([pl.BlockSpec((t.block_vocab,), lambda j: (j,))]
                     if options.has_bias else [])],
        out_shape=[f32(p) for p in padded[1:]], **common,
    )(*args)
  return dx[:dims.R, :dims.H], dw[:dims.H, :dims.V], db[0][:dims.V] if db else None


def _hopper_unsupported(dtype, tiling: LinearCrossEntropyTiling, interpret: bool):
  """Why the Hopper forward cannot run, or None. An explicit ``forward="mosaic_gpu"``
  runs interpreted off a GPU; the default is interpreted only as Triton (the interpreter
  that every kernel of this op has)."""
  why = mosaic_gpu.supported(dtype, tiling.hopper_tiling)
  if why is None and interpret and tiling.forward is None:
    why = "interpret mode runs the Triton forward unless forward='mosaic_gpu' is asked for"
  if why is None and not interpret and not mosaic_device.hopper_device():
    why = f"it needs a Hopper GPU, and the device is {mosaic_device.device_description()}"
  return why


def _dlogits_unsupported(dtype, dims: _Dims, has_bias: bool, interpret: bool):
  """Why the Hopper dlogits kernel cannot serve the chunked backward, or None."""
  t = dims.tiling
  if jnp.dtype(dtype) != jnp.bfloat16:
    return f"it writes ds in bfloat16 for bfloat16 inputs, not {jnp.dtype(dtype)}"
  if has_bias:
    return "dbias needs ds in float32; with a bias the chunked backward forms it in XLA"
  if t.backward not in (None, "chunked"):
    return f"it serves the chunked backward, not backward={t.backward!r}"
  if dims.chunk % t.hopper_tiling.block_vocab:
    return (f"the chunk ({dims.chunk} columns) must be a multiple of block_vocab "
            f"({t.hopper_tiling.block_vocab})")
  needed = mosaic_gpu.dlogits_smem_bytes(t.hopper_tiling, jnp.dtype(dtype).itemsize)
  if needed > mosaic_device.SMEM_BYTES:
    return f"it needs {needed} bytes of shared memory, more than {mosaic_device.SMEM_BYTES}"
  if interpret and t.dlogits is None:
    return "interpret mode forms ds in XLA unless dlogits='mosaic_gpu' is asked for"
  if not interpret and not mosaic_device.hopper_device():
    return f"it needs a Hopper GPU, and the device is {mosaic_device.device_description()}"
  return None


def _with_hopper_kernel(tiling: LinearCrossEntropyTiling, field: str, portable: str,
                        why: str | None, op: str) -> LinearCrossEntropyTiling:
  """``tiling`` with its ``field`` ("forward" or "dlogits") decided: "mosaic_gpu" where
  asked for, or left to the default and ``why`` (the reason the Hopper kernel cannot
  run) is None, else ``portable``. Asking for "mosaic_gpu" where it cannot run is an
  error."""
  value = getattr(tiling, field)
  if value == "mosaic_gpu" and why is not None:
    raise ValueError(f"{op}: tiling.{field}='mosaic_gpu' cannot run: {why}")
  if value is None:
    return dataclasses.replace(tiling, **{field: portable if why else "mosaic_gpu"})
  return tiling


def _loss(lse, label_logit, total, labels, dims: _Dims, options: _Options):
  a = options.label_smoothing
  # Terms with a zero coefficient are left out, as the reference does: with infinite
  # logits they would make 0·inf = NaN where the loss is +inf.
  loss = lse - (1 - a) * label_logit
  if a:
    loss = loss - a * total / dims.V
  if options.z_loss:
    loss = loss + options.z_loss * lse * lse
  in_range = (labels >= 0) & (labels < dims.V)
  return jnp.where(in_range, loss, jnp.nan)  # ignored rows are zeroed by the caller


# --- derivatives: reverse mode on the kernels, a clear error otherwise ------------------
# The (loss, lse) tangent is a linear map of (dhidden, dweight[, dbias]) whose transpose
# is the backward (`_backward`); reverse mode only transposes it. Evaluating it (forward
# mode) or differentiating it again (second order) would need the logits' own
# derivatives, which these kernels never form: both raise this.
_REVERSE_ONLY = (
    "linear_cross_entropy is differentiable in reverse mode (jax.grad, jax.vjp) only: "
    "forward mode (jax.jvp, jax.jacfwd, jax.linearize) and second derivatives "
    "(jax.hessian, jvp of grad) are not supported by its fused kernels. For those, form "
    "the logits and use cross_entropy, which supports every mode: "
    "cross_entropy(jnp.dot(hidden, weight, preferred_element_type=jnp.float32), labels)")


def _tangent_kernel(res, t, *, sizes: _Dims, options: _Options):
  raise NotImplementedError(_REVERSE_ONLY)


def _tangent_types(res, t, *, sizes: _Dims, options: _Options):
  del t, sizes, options
  m = res[4]  # (R,) float32, varying over the mesh axes the inputs vary over
  return m, m


def _transpose_kernel(res, cts, *, sizes: _Dims, options: _Options):
  x, w, b, labels, m, log_l = res
  g, g_lse = cts
  # Rows with a label out of range (possible only inside jit) give NaN gradients.
  in_range = (labels >= 0) & (labels < sizes.V)
  g = jnp.where(in_range | (g == 0), g.astype(jnp.float32), jnp.nan)
  rows = _Rows(labels, m, log_l, g, g_lse.astype(jnp.float32))
  dx, dw, db = _backward(x, w, b, rows, sizes, options)
  return (dx.astype(x.dtype), dw.astype(w.dtype)) + (() if b is None else
                                                     (db.astype(b.dtype),))


def _transpose_types(res, cts, *, sizes: _Dims, options: _Options):
  del cts, sizes, options
  x, w, b = res[:3]
  return (x, w) + (() if b is None else (b,))


# The weight is no row's own: under vmap the maps run once per batch element. (The
# problem's sizes go as "sizes": JAX's batching rules take an argument named dims.)
_TANGENT = LinearMap("linear_cross_entropy_tangent", kernel=_tangent_kernel, twin=None,
                     out_types=_tangent_types, no_twin=_REVERSE_ONLY,
                     fold_rows=lambda **_: False).pair(
    LinearMap("linear_cross_entropy_transpose", kernel=_transpose_kernel, twin=None,
              out_types=_transpose_types, no_twin=_REVERSE_ONLY, fold_rows=lambda **_: False))


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _state(x, w, b, labels, dims: _Dims, options: _Options):
  """(loss, lse, m, log l) of each row: the losses and the residuals of the backward.
  Differentiated only at second order (`_rows` differentiates the losses): an error."""
  m, log_l, label_logit, total = _forward(x, w, b, labels, dims, options)
  lse = m + log_l
  return _loss(lse, label_logit, total, labels, dims, options), lse, m, log_l


@_state.defjvp
def _state_jvp(dims: _Dims, options: _Options, primals, tangents):
  raise NotImplementedError(_REVERSE_ONLY)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _rows(x, w, b, labels, dims: _Dims, options: _Options):
  return _state(x, w, b, labels, dims, options)[:2]


@_rows.defjvp
def _rows_jvp(dims: _Dims, options: _Options, primals, tangents):
  x, w, b, labels = primals
  loss, lse, m, log_l = _state(x, w, b, labels, dims, options)
  t = tuple(tangents[:2]) + (() if b is None else (tangents[2],))
  return (loss, lse), _TANGENT((x, w, b, labels, m, log_l), t, sizes=dims, options=options)


def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         logit_soft_cap: float | None = None, reduction: str = "mean",
                         return_lse: bool = False,
                         tiling: LinearCrossEntropyTiling | None = None,
                         interpret: bool | None = None):
  """Softmax cross-entropy of the logits ``hidden @ weight (+ bias)`` and integer
  ``labels``, without materializing the logits.

  The same numbers as `jaxsoftmax.cross_entropy` applied to
  ``jnp.dot(hidden, weight, preferred_element_type=jnp.float32) + bias`` (after
  ``logit_soft_cap``, if given).

  Args:
    hidden: (..., H) float32, bfloat16 or float16 (float64 takes the reference path).
    weight: (H, V), the dtype of ``hidden``.
    labels: integer class indices, ``hidden.shape[:-1]``.
    bias: optional (V,) logit bias, the dtype of ``hidden``.
    ignore_index, label_smoothing, z_loss, reduction, return_lse: as
      `jaxsoftmax.cross_entropy`.
    logit_soft_cap: c > 0: the logits become c·tanh(logits / c) first (Gemma 2).
    tiling: optional `LinearCrossEntropyTiling`.
    interpret: run the kernels in Pallas interpret mode; see `jaxsoftmax.softmax`.

  Returns:
    The float32 loss, or ``(loss, lse)`` with ``return_lse`` (lse per row, float32).
  """
  op = "linear_cross_entropy"
  hidden = check_floating(hidden, "hidden", op)
  weight = check_floating(weight, "weight", op)
  labels = jnp.asarray(labels)
  if hidden.ndim < 1 or weight.ndim != 2 or weight.shape[0] != hidden.shape[-1]:
    raise ValueError(f"{op}: hidden (..., H) and weight (H, V) must share H, got hidden "
                     f"{hidden.shape} and weight {weight.shape}")
  if weight.dtype != hidden.dtype:
    raise TypeError(f"{op}: weight must have the dtype of hidden ({hidden.dtype}), got "
                    f"{weight.dtype}")
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"{op}: labels must be integers, got {labels.dtype}")
  if labels.shape != hidden.shape[:-1]:
    raise ValueError(f"{op}: labels of shape {labels.shape} must have the shape of hidden "
                     f"without its last axis, {hidden.shape[:-1]}")
  H, V = weight.shape
  if V == 0:
    raise ValueError(f"{op}: weight must have a non-empty vocabulary, got shape "
                     f"{weight.shape}")
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (V,) or bias.dtype != hidden.dtype:
      raise ValueError(f"{op}: bias must have shape ({V},) and dtype {hidden.dtype}, got "
                       f"{bias.dtype} {bias.shape}")
  if reduction not in REDUCTIONS:
    raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
  if not 0.0 <= label_smoothing <= 1.0:
    raise ValueError(f"{op}: label_smoothing must lie in [0, 1], got {label_smoothing!r}")
  if z_loss < 0:
    raise ValueError(f"{op}: z_loss must be >= 0, got {z_loss!r}")
  if logit_soft_cap is not None and not logit_soft_cap > 0:
    raise ValueError(f"{op}: logit_soft_cap must be > 0, got {logit_soft_cap!r}")
  if tiling is not None and not isinstance(tiling, LinearCrossEntropyTiling):
    raise TypeError(f"{op}: tiling must be a LinearCrossEntropyTiling, got {tiling!r}")
  check_labels(labels, V, ignore_index, op)
  if (hidden.dtype == jnp.float64 or hidden.size == 0 or labels.size == 0
      or _backend.xla_by_default(interpret, kernel_asked=tiling is not None)):
    # The XLA path: the logits (in float32 at least) in memory, then the reference loss.
    acc = jnp.promote_types(hidden.dtype, jnp.float32)
    logits = jnp.dot(hidden, weight, preferred_element_type=acc)
    if bias is not None:
      logits = logits + bias.astype(acc).reshape((1,) * (logits.ndim - 1) + (V,))
    if logit_soft_cap is not None:
      logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
    loss = reference.cross_entropy(logits, labels, ignore_index=ignore_index,
                                   label_smoothing=label_smoothing, z_loss=z_loss,
                                   reduction=reduction)
    return (loss, reference.logsumexp(logits, axis=-1)) if return_lse else loss

  interpret = _backend.resolve_interpret(interpret)
  tiling = tiling or LinearCrossEntropyTiling()
  if tiling.forward != "triton":
    tiling = _with_hopper_kernel(tiling, "forward", "triton",
                                 _hopper_unsupported(hidden.dtype, tiling, interpret), op)
  flat_labels = labels.reshape(-1).astype(jnp.int32)
  dims = _Dims(flat_labels.size, H, V, tiling)
  if tiling.dlogits != "xla":
    # By default the Hopper kernel where it runs: it saves XLA's float32 logits and their
    # elementwise pass, 54.2 against 57.7 ms of kernels a step (benchmarks/results/
    # README.md, "Fifth run").
    tiling = _with_hopper_kernel(
        tiling, "dlogits", "xla",
        _dlogits_unsupported(hidden.dtype, dims, bias is not None, interpret), op)
    dims = dataclasses.replace(dims, tiling=tiling)
  options = _Options(float(label_smoothing), float(z_loss),
                     None if logit_soft_cap is None else float(logit_soft_cap),
                     bias is not None, interpret)
  hidden, weight, bias, flat_labels = _backend.vary_together(hidden, weight, bias, flat_labels)
  loss, lse = _rows(hidden.reshape(-1, H), weight, bias, flat_labels, dims, options)
  loss = reduce_losses(jnp.where(flat_labels != ignore_index, loss, 0.0), labels, None,
                       ignore_index, reduction)
  return (loss, lse.reshape(labels.shape)) if return_lse else loss
