"""The linear + cross-entropy kernels for Hopper GPUs in Pallas Mosaic GPU: tensor-core
matrix products whose epilogue keeps the online-softmax state instead of storing logits
(the forward), or forms the logits' gradient ds (`dlogits`, for the chunked backward).

The "mosaic_gpu" backend of `linear_cross_entropy` (``implementation="mosaic_gpu"``, the
default for 16-bit inputs on a Hopper GPU; `unsupported`, `forward`, `chunk_ds` below),
its tiles from `LinearCrossEntropyHopperTiling`. For rows x (R, H), weight W (H, V) and an optional
bias, one CTA per (vocabulary range, block of 2·64 rows), the ranges fastest so that
the CTAs running at once share their row blocks in L2; three warpgroups:

- the producer (warpgroup 2) walks the range's vocabulary tiles and, for each, the hidden
  dim in chunks of 64: it copies the two consumers' x chunks (64 x 64 each) and the W
  chunk (64 x block_vocab) by TMA into a ring of ``num_stages`` shared-memory slots,
  each with a "loaded" barrier the three copies complete and a "free" barrier both
  consumers arrive on;
- two consumers (warpgroups 0 and 1) own 64 rows each. Per vocabulary tile they
  accumulate z = Σ_chunks x·W by wgmma in float32 registers (the product of chunk c is
  waited for only after chunk c + 1's is issued, and then c's slot is freed), then
  update the online softmax of their rows from the registers: s = cap(z + b) (+ -inf
  on the padding columns), m' = max(m, max_j s), l' = l·2^((m - m')·log2 e) +
  Σ_j 2^((s - m')·log2 e), and, under a soft cap with label smoothing, Σ_j s.

Outputs: per (range, row) m, l (and Σ_j s) in float32, which `linear_cross_entropy`
merges over the ranges; the label's logit, and Σ_j s without a soft cap (x·(W·1) + Σ b),
are cheap outside the kernel. Nothing R x V reaches memory.

`dlogits` runs the same producer and products for one vocabulary chunk of the chunked
backward: one CTA per (vocabulary tile, group of row blocks), each consumer forming
ds = g·[(1 + 2ζ·lse)·p - (1 - a)·[j = y] - a / V] + g_lse·p (times 1 - (s/c)² under a
soft cap) from its z tile and per-row values, and sending it out in bfloat16 by TMA
while the producer loads the next row block.

TMA moves the (8, 64) tiles of the swizzled shared-memory layout, so the rows are padded
to a multiple of 8 and H and V to multiples of 64 where they are not (a copy of W then:
V = 131072, 256000, 32000, 128256 need none); rows and columns past the arrays, up to
whole tiles, TMA reads as zeros, and the logits of the padding columns are set to -inf
where the padding vector is -inf (selected, not added: an infinite hidden value times a
zero column is NaN).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsoftmax._core import mosaic_gpu as device
from jaxsoftmax._core import pallas
from jaxsoftmax._core.mosaic_gpu import (SMEM_BYTES, div32, pad_to, per_row, pl, plgpu,
                                        rem32, warp_specialized_kernel, wgmma_iota)
from jaxsoftmax._core.state import LOG2E
from jaxsoftmax.linear_cross_entropy.call import Call, ChunkDs
from jaxsoftmax.linear_cross_entropy.logits import Rows, capped, merged_state, p_coefficient
from jaxsoftmax.linear_cross_entropy.tiling import (HOPPER_BLOCK_HIDDEN, HOPPER_BLOCK_ROWS,
                                                    HOPPER_CONSUMERS,
                                                    LinearCrossEntropyHopperTiling)

__all__ = ["NAME", "STATE_FROM_XLA", "unsupported", "forward", "chunk_ds", "DlogitsInputs",
           "dlogits", "dlogits_inputs", "range_states"]

NAME = "mosaic_gpu"
STATE_FROM_XLA = False

_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a consumer's tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per vocabulary column of a tile
_CONSUMERS = HOPPER_CONSUMERS
_BLOCK_ROWS = HOPPER_BLOCK_ROWS  # rows per consumer: one wgmma row block
_BLOCK_HIDDEN = HOPPER_BLOCK_HIDDEN  # hidden-dim chunk
# Registers per thread, as in the attention forward: 2 · 128 · 232 + 128 · 40 = 64512.
_CONSUMER_REGISTERS = 232
_PRODUCER_REGISTERS = 40
# Row values of the dlogits kernel: m, log2 l, and the coefficients of p, of the label
# and of the smoothing (`dlogits_inputs`).
_ROWVALS = 5


@dataclasses.dataclass(frozen=True)
class _HopperProblem:
  R: int
  H: int
  V: int
  tiling: LinearCrossEntropyHopperTiling
  softcap: float | None
  has_bias: bool
  with_total: bool  # Σ_j s in the kernel (soft cap and label smoothing)

  @property
  def pad_columns(self) -> bool:
    """Whether a vector of 0 / -inf past the vocabulary (and the bias) is added to
    every tile."""
    return self.has_bias or self.V % self.tiling.block_vocab != 0

  @property
  def block_rows(self) -> int:
    return _CONSUMERS * _BLOCK_ROWS

  @property
  def row_blocks(self) -> int:
    return pl.cdiv(self.R, self.block_rows)

  @property
  def vocab_tiles(self) -> int:
    return pl.cdiv(self.V, self.tiling.block_vocab)

  @property
  def hidden_chunks(self) -> int:
    return pl.cdiv(self.H, _BLOCK_HIDDEN)

  def splits(self) -> tuple[int, int]:
    """(vocabulary ranges, tiles per range); every range holds a tile."""
    wanted = self.tiling.vocab_splits or pl.cdiv(self.vocab_tiles, 32)
    return pallas.even_groups(self.vocab_tiles, wanted)


class _Ring(NamedTuple):
  """The shared-memory ring the producer fills and the consumers' products drain: per
  slot both consumers' x chunks and a W chunk, a "loaded" barrier (the three copies) and
  a "free" barrier (both consumers)."""

  x_smem: Any
  w_smem: Any
  loaded: Any
  free: Any
  stages: int
  chunks: int  # hidden chunks of one tile


_TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _ring_scratch(stages: int, bv: int, dtype) -> list:
  """The scratch of a `_Ring`, in its order: x chunks, W chunks, "loaded" and "free"
  barriers (TMA writes the chunks in the swizzled layout wgmma reads)."""
  return [
      plgpu.SMEM((stages, _CONSUMERS, _BLOCK_ROWS, _BLOCK_HIDDEN), dtype, transforms=_TILED),
      plgpu.SMEM((stages, _BLOCK_HIDDEN, bv), dtype, transforms=_TILED),
      plgpu.Barrier(num_arrivals=_CONSUMERS + 1, num_barriers=stages),  # slot loaded
      plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),  # slot free
  ]


def _produce(ring: _Ring, x_ref, w_ref, tiles, origin, bv: int):
  """The producer warpgroup: for each of the CTA's ``tiles`` logit tiles, at (first row,
  vocabulary tile) ``origin(t)``, and each hidden chunk, TMA copies of the two consumers'
  x chunks and the W chunk into the next free slot."""
  plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
  stages, chunks = ring.stages, ring.chunks

  @pl.loop(0, tiles * chunks)
  def _(g):
    s = rem32(g, stages)
    t, c = div32(g, chunks), rem32(g, chunks)
    r0, vocab_tile = origin(t)
    hidden = pl.ds(c * _BLOCK_HIDDEN, _BLOCK_HIDDEN)
    pl.when(g >= stages)(lambda: plgpu.barrier_wait(ring.free.at[s]))
    for w in range(_CONSUMERS):
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(r0 + w * _BLOCK_ROWS, _BLOCK_ROWS), hidden],
                              ring.x_smem.at[s, w], ring.loaded.at[s])
    plgpu.copy_gmem_to_smem(w_ref.at[hidden, pl.ds(vocab_tile * bv, bv)], ring.w_smem.at[s],
                            ring.loaded.at[s])

  # Wait for the last slots to be freed too: every phase of the "free" barriers is then
  # observed before they are deallocated (Pallas' Mosaic GPU interpreter checks that).
  @pl.loop(tiles * chunks, tiles * chunks + stages)
  def _(g):
    pl.when(g >= stages)(lambda: plgpu.barrier_wait(ring.free.at[rem32(g, stages)]))


def _safe(m):
  """m where it is finite, else 0 (`state.safe_shift`, in operations Mosaic GPU lowers)."""
  return jnp.where(m == jnp.inf, 0.0, jnp.where(m == -jnp.inf, 0.0, m))


def _tile_logits(ring: _Ring, wg, t, bv: int):
  """A consumer's float32 logit tile z (64 x bv) of the CTA's vocabulary tile t, by wgmma
  over the hidden chunks."""
  stages, chunks = ring.stages, ring.chunks
  step0 = t * chunks

  def products(acc_ref):
    @pl.loop(0, chunks)
    def _(c):
      s = rem32(step0 + c, stages)
      plgpu.barrier_wait(ring.loaded.at[s])
      plgpu.wgmma(acc_ref, ring.x_smem.at[s, wg], ring.w_smem.at[s])
      # Keep this product in flight; the previous one is done: free its slot.
      plgpu.wgmma_wait(1)
      pl.when(c > 0)(lambda: plgpu.barrier_arrive(
          ring.free.at[rem32(step0 + c - 1, stages)]))

    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(ring.free.at[rem32(step0 + chunks - 1, stages)])
    return acc_ref[...]

  return pl.run_scoped(products, plgpu.ACC((_BLOCK_ROWS, bv), jnp.float32))


def _kernel(x_ref, w_ref, *refs, plan: _HopperProblem, per: int):
  refs = list(refs)
  pad_ref = refs.pop(0) if plan.pad_columns else None
  m_ref, l_ref = refs.pop(0), refs.pop(0)
  total_ref = refs.pop(0) if plan.with_total else None
  *ring_refs, stat_smem = refs
  ring = _Ring(*ring_refs, plan.tiling.num_stages, plan.hidden_chunks)

  bv = plan.tiling.block_vocab
  wg = lax.axis_index("wg")
  split, row_block = lax.axis_index("splits"), lax.axis_index("rows")
  first = split * per
  tiles = jnp.minimum(per, plan.vocab_tiles - first)  # the last range may be shorter
  r0 = row_block * plan.block_rows

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")

    def tile(t, carry):
      m, l, total = carry
      s = _tile_logits(ring, wg, t, bv)
      shape = s.shape
      pad = None
      if pad_ref is not None:  # the bias, and -inf past the vocabulary
        pad = plgpu.load(pad_ref.at[0, pl.ds((first + t) * bv, bv)], layout=_COL,
                         optimized=False)
        bias = plgpu.load(pad_ref.at[1, pl.ds((first + t) * bv, bv)], layout=_COL,
                          optimized=False)
        s = s + lax.broadcast_in_dim(bias, shape, [1])
      if plan.softcap is not None:
        s = plan.softcap * jnp.tanh(s / plan.softcap)
      if total is not None:  # the padding columns are masked out of the sum
        valid = s if pad is None else jnp.where(
            lax.broadcast_in_dim(pad, shape, [1]) == 0, s, 0.0)
        total = total + valid.sum(axis=1)
      if pad is not None:  # selected, not added: an infinite hidden value times the
        # padding's zero columns is NaN there
        s = jnp.where(lax.broadcast_in_dim(pad, shape, [1]) == 0, s, -jnp.inf)
      # l is relative to m made safe (_core/state.py: 0 for an infinite m), so a +inf logit
      # gives l = +inf and lse = +inf, as jax.nn.logsumexp does; the empty state's
      # l = 0 stays 0 however far the shift moves.
      m_new = jnp.maximum(m, s.max(axis=1))
      shift = _safe(m_new) * LOG2E
      p = jnp.exp2(s * LOG2E - lax.broadcast_in_dim(shift, shape, [0]))
      l = jnp.where(l > 0, l * jnp.exp2(_safe(m) * LOG2E - shift), l) + p.sum(axis=1)
      return m_new, l, total

    def row(x):
      return plgpu.layout_cast(x, _ROW)

    init = (row(jnp.full((_BLOCK_ROWS,), -jnp.inf, jnp.float32)),
            row(jnp.zeros((_BLOCK_ROWS,), jnp.float32)),
            row(jnp.zeros((_BLOCK_ROWS,), jnp.float32)) if plan.with_total else None)
    m, l, total = lax.fori_loop(0, tiles, tile, init)
    rows = pl.ds(r0 + wg * _BLOCK_ROWS, _BLOCK_ROWS)
    outputs = [(m, m_ref), (l, l_ref)] + ([(total, total_ref)] if plan.with_total else [])
    for i, (value, ref) in enumerate(outputs):
      stat_smem.at[i, wg][...] = value
    plgpu.commit_smem()
    for i, (_, ref) in enumerate(outputs):
      plgpu.copy_smem_to_gmem(stat_smem.at[i, wg], ref.at[split, rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _CONSUMERS)
  def _producer():
    _produce(ring, x_ref, w_ref, tiles, lambda t: (r0, first + t), bv)


def range_states(x, w, b, *, tiling: LinearCrossEntropyHopperTiling, softcap: float | None,
                 with_total: bool, interpret: bool = False):
  """(m, l, Σ_j s or None), float32 (splits, R_pad), of rows x (R, H) against w (H, V)
  and the optional bias b (V,), bfloat16 or float16: each range's online-softmax state
  of the logits s = cap(x w + b). ``interpret``: run in Pallas' Mosaic GPU interpreter
  on the CPU (it simulates the warpgroups, barriers, TMA and wgmma)."""
  R, H = x.shape
  V = w.shape[1]
  # TMA moves the (8, 64) tiles of the shared-memory layout: the rows are padded to a
  # multiple of 8, the hidden dim and the vocabulary to multiples of 64 (a copy of W
  # only for such sizes).
  H64, V64 = -(-H // 64) * 64, -(-V // 64) * 64
  x = pad_to(pad_to(x, 0, -(-R // 8) * 8), 1, H64)
  w = pad_to(pad_to(w, 0, H64), 1, V64)
  plan = _HopperProblem(R, H, V, tiling, softcap, b is not None, with_total)
  splits, per = plan.splits()
  bv = tiling.block_vocab
  V_pad = plan.vocab_tiles * bv
  R_pad = plan.row_blocks * plan.block_rows
  args = [x, w]
  if plan.pad_columns:
    # Row 0: 0 on the vocabulary, -inf past it; row 1: the bias (0 past it).
    pad = jnp.where(jnp.arange(V_pad) < V, 0.0, -jnp.inf).astype(jnp.float32)
    bias = jnp.zeros((V_pad,), jnp.float32) if b is None else pad_to(
        b.astype(jnp.float32), 0, V_pad)
    args.append(jnp.stack([pad, bias]))
  stat = jax.ShapeDtypeStruct((splits, R_pad), jnp.float32)
  # The outputs' tiles are waited for explicitly (`compiler_params`). Scratch: the ring's
  # (`_ring_scratch`), then the kernel's own.
  outputs = warp_specialized_kernel(
      functools.partial(_kernel, plan=plan, per=per), consumers=_CONSUMERS,
      out_type=[stat] * (3 if with_total else 2),
      scratch_types=_ring_scratch(tiling.num_stages, bv, x.dtype)
      + [plgpu.SMEM((3, _CONSUMERS, _BLOCK_ROWS), jnp.float32)],  # statistics going out
      grid=(splits, plan.row_blocks), grid_names=("splits", "rows"), softcap=softcap,
      name="linear_cross_entropy_forward_mosaic_gpu", interpret=interpret,
  )(*args)
  m, l, *total = outputs
  return m[:, :R], l[:, :R], total[0][:, :R] if total else None


def _kernel_unsupported(dtype, tiling: LinearCrossEntropyHopperTiling) -> str | None:
  """Why the Hopper forward cannot take these inputs, or None."""
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return f"its tensor-core products take bfloat16 or float16, not {jnp.dtype(dtype)}"
  needed = tiling.smem_bytes(jnp.dtype(dtype).itemsize)
  if needed > SMEM_BYTES:
    return f"it needs {needed} bytes of shared memory, more than {SMEM_BYTES}"
  return None


def _dlogits_kernel(x_ref, w_ref, rowvals_ref, labels_ref, ds_ref, x_smem, w_smem, loaded,
                    free, ds_smem, *, chunks: int, stages: int, per: int, row_blocks: int,
                    softcap: float | None):
  """One CTA per (vocabulary tile of the chunk, group of ``per`` blocks of 2·64 rows),
  about one CTA per SM: for each block, the tile's logits by wgmma as in the forward,
  then ds from them in registers, sent out in x's dtype by TMA while the producer
  already loads the next block's chunks."""
  ring = _Ring(x_smem, w_smem, loaded, free, stages, chunks)
  bv = w_smem.shape[-1]
  wg = lax.axis_index("wg")
  tile, group = lax.axis_index("tiles"), lax.axis_index("rows")
  first = group * per
  blocks = jnp.minimum(per, row_blocks - first)  # the last group may be shorter
  row0 = lambda t: (first + t) * _CONSUMERS * _BLOCK_ROWS

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")

    @pl.loop(0, blocks)
    def _(t):
      rows = pl.ds(row0(t) + wg * _BLOCK_ROWS, _BLOCK_ROWS)
      # The rows' values, loaded before the products so that their latency hides there.
      load = lambda ref: plgpu.load(ref, layout=_ROW, optimized=False)
      m, log2_l, p_coef, label_coef, smoothing = (load(rowvals_ref.at[i, rows])
                                                  for i in range(_ROWVALS))
      label = load(labels_ref.at[rows])
      z = _tile_logits(ring, wg, t, bv)
      shape = z.shape
      by_row = functools.partial(per_row, shape=shape)
      s = z if softcap is None else softcap * jnp.tanh(z / softcap)
      # s - m first: exact where s is near m, which an lse rounded to float32 is not.
      p = jnp.exp2((s - by_row(m)) * LOG2E - by_row(log2_l))
      cols = tile * bv + wgmma_iota(shape, 1)
      ds = (by_row(p_coef) * p
            - jnp.where(cols == by_row(label), by_row(label_coef), 0.0)
            - by_row(smoothing))
      if softcap is not None:  # ds/dz = 1 - tanh² = 1 - (s/c)²
        ds = ds * (1.0 - jnp.square(s / softcap))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last block's ds has left
      ds_smem.at[wg][...] = ds.astype(ds_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(ds_smem.at[wg], ds_ref.at[rows, pl.ds(tile * bv, bv)])

    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _CONSUMERS)
  def _producer():
    _produce(ring, x_ref, w_ref, blocks, lambda t: (row0(t), tile), bv)


class DlogitsInputs(NamedTuple):
  """What every chunk's `dlogits` call shares: x padded for TMA (rows to a multiple of
  2·64, H to one of 64), the (_ROWVALS, R_pad) row values and the labels (R_pad,)."""

  x: jax.Array
  rowvals: jax.Array
  labels: jax.Array


def dlogits_inputs(x, labels, m, log_l, g, p_coefficient, *, V: int,
                   label_smoothing: float) -> DlogitsInputs:
  """The chunk-independent operands of `dlogits`, for ds = p_coefficient·p - g·[(1 - a)·
  [j = y] + a / V], p = exp((s - m) - log l), with each row's softmax state as its
  shift m and log l and p_coefficient = g·(1 + 2ζ·lse) + g_lse (the module docstring of
  `linear_cross_entropy`, and its `p_coefficient`)."""
  R, H = x.shape
  R_pad = -(-R // (_CONSUMERS * _BLOCK_ROWS)) * _CONSUMERS * _BLOCK_ROWS
  a = label_smoothing
  # The rows of the kernel's (_ROWVALS, R_pad) float32 operand, in the order it
  # unpacks them.
  rowvals = jnp.stack([m, log_l * LOG2E, p_coefficient, g * (1 - a),
                       g * (a / V)]).astype(jnp.float32)
  return DlogitsInputs(pad_to(pad_to(x, 0, R_pad), 1, -(-H // 64) * 64),
                       pad_to(rowvals, 1, R_pad), pad_to(labels.astype(jnp.int32), 0, R_pad))


def dlogits(inputs: DlogitsInputs, w_chunk, start, *, tiling: LinearCrossEntropyHopperTiling,
            softcap: float | None, interpret: bool = False):
  """ds (R_pad, chunk) in x's dtype, the loss's gradient with respect to the logits of the
  vocabulary columns [start, start + chunk), from their weight columns ``w_chunk`` (H,
  chunk; chunk a multiple of ``tiling.block_vocab``) and `dlogits_inputs`. The rows past
  R are those of zero rows (their coefficients are 0)."""
  x, rowvals, labels = inputs
  R_pad, H64 = x.shape
  chunk = w_chunk.shape[1]
  bv, stages = tiling.block_vocab, tiling.num_stages
  if chunk % bv:
    raise ValueError(f"dlogits: the chunk ({chunk} columns) must be a multiple of "
                     f"block_vocab ({bv})")
  # About one CTA per SM (each takes most of an SM's shared memory, so one runs at a
  # time): the chunk's tiles times groups of row blocks, each CTA walking its group.
  row_blocks = R_pad // (_CONSUMERS * _BLOCK_ROWS)
  groups, per = pallas.even_groups(row_blocks, pl.cdiv(pallas.num_cores(), chunk // bv))
  return warp_specialized_kernel(
      functools.partial(_dlogits_kernel, chunks=H64 // _BLOCK_HIDDEN, stages=stages,
                        per=per, row_blocks=row_blocks, softcap=softcap), consumers=_CONSUMERS,
      out_type=jax.ShapeDtypeStruct((R_pad, chunk), x.dtype),
      scratch_types=_ring_scratch(stages, bv, x.dtype)
      + [plgpu.SMEM((_CONSUMERS, _BLOCK_ROWS, bv), x.dtype, transforms=_TILED)],  # ds out
      grid=(chunk // bv, groups), grid_names=("tiles", "rows"), softcap=softcap,
      name="linear_cross_entropy_dlogits_mosaic_gpu", interpret=interpret,
  )(x, pad_to(w_chunk, 0, H64), rowvals, labels - start)


# --- the backend: what `linear_cross_entropy`'s registry calls (`call.LinearCrossEntropyBackend`)


def unsupported(call: Call) -> str | None:
  """Why the Hopper kernels cannot run ``call``, or None. Named, they also run in Pallas'
  Mosaic GPU interpreter off a GPU; by default interpret mode runs the Triton forward
  (the cheaper one to interpret)."""
  why = _kernel_unsupported(call.dtype, call.dims.tiling.hopper_tiling)
  if why is None and call.interpret and not call.named:
    why = ("interpret mode runs the Triton forward unless implementation='mosaic_gpu' is "
           "asked for")
  if why is None and not call.interpret and not device.hopper_device():
    why = f"it needs a Hopper GPU, and the device is {device.device_description()}"
  return why


def forward(x, w, b, labels, call: Call):
  """Per row: the softmax state from the ranges' states of `range_states`; the label's
  logit, and Σ_j s without a soft cap, from XLA's products beside it."""
  options, V = call.options, call.dims.V
  with_total = options.softcap is not None and options.label_smoothing > 0
  m, l, total = range_states(x, w, b, tiling=call.dims.tiling.hopper_tiling,
                             softcap=options.softcap, with_total=with_total,
                             interpret=options.interpret)
  m, log_l = merged_state(m, l)
  # s_y = cap(x_r · W[:, y_r] + b_y); an out-of-range label's row is NaN in the loss.
  y = jnp.clip(labels, 0, V - 1)
  z_y = jnp.einsum("rh,hr->r", x, jnp.take(w, y, axis=1),
                   preferred_element_type=jnp.float32)
  if b is not None:
    z_y = z_y + b[y].astype(jnp.float32)
  s_y = capped(z_y, options)[0]
  if with_total:
    total = total.sum(axis=0)
  elif options.label_smoothing > 0:  # Σ_j z_j = x · (W 1) + Σ_j b_j
    # In float32 throughout: W 1 rounded to x's 16 bits put the smoothing term's error
    # at 27 float32 ulps of the loss (bfloat16, 301 columns), the Triton kernels' at 1.
    # A matrix-vector product, R x H: full precision costs nothing that shows.
    total = jnp.dot(x.astype(jnp.float32), jnp.sum(w, axis=1, dtype=jnp.float32),
                    precision=lax.Precision.HIGHEST)
    if b is not None:
      total = total + jnp.sum(b, dtype=jnp.float32)
  else:
    total = jnp.zeros_like(m)
  return m, log_l, s_y, total


def _dlogits_unsupported(call: Call) -> str | None:
  """Why the ds kernel cannot serve the chunked backward of ``call``, or None."""
  dims, tiling = call.dims, call.dims.tiling.hopper_tiling
  if jnp.dtype(call.dtype) != jnp.bfloat16:
    return f"it writes ds in bfloat16 for bfloat16 inputs, not {call.dtype}"
  if call.options.has_bias:
    return "dbias needs ds in float32; with a bias the chunked backward forms it in XLA"
  if dims.chunk % tiling.block_vocab:
    return (f"the chunk ({dims.chunk} columns) must be a multiple of block_vocab "
            f"({tiling.block_vocab})")
  needed = tiling.dlogits_smem_bytes(jnp.dtype(call.dtype).itemsize)
  if needed > SMEM_BYTES:
    return f"it needs {needed} bytes of shared memory, more than {SMEM_BYTES}"
  return None


def chunk_ds(x, rows: Rows, call: Call) -> ChunkDs | None:
  """`dlogits` for each chunk of the chunked backward where it can run (bfloat16 without
  a bias; else None: XLA's product and an elementwise pass). It saves XLA's float32
  logits and their pass: forward + backward 56.9 against 60.3 ms at H = 4096 on the H200
  (docs/kernels.md, "Linear cross-entropy")."""
  if _dlogits_unsupported(call) is not None:
    return None
  options = call.options
  shared = dlogits_inputs(x, rows.labels, rows.m, rows.log_l, rows.g,
                          p_coefficient(rows.g, rows.g_lse, rows.lse, options.z_loss),
                          V=call.dims.V, label_smoothing=options.label_smoothing)
  return lambda w_c, start: dlogits(shared, w_c, start, tiling=call.dims.tiling.hopper_tiling,
                                    softcap=options.softcap,
                                    interpret=options.interpret)[:call.dims.R]
