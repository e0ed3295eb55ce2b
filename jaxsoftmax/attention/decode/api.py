"""`decode_attention`: attention of a few new tokens per sequence against a KV cache,
contiguous or paged (docs/kernels.md, "Decode attention").

Kernels: `mosaic_gpu` (Hopper GPUs: the K/V blocks streamed by TMA through a ring of
shared-memory slots, wgmma products, persistent CTAs) and `triton` (flash-decoding in
Pallas' Triton lowering, any GPU and the CPU interpreter). Both split the cache over
programs and pack the query heads of a KV head into one tile, and their splits merge in
float32 in a second small kernel (`triton.merge`). With ``implementation=None`` a Hopper
GPU takes `mosaic_gpu` where it supports the call (`mosaic_gpu.unsupported`) once
`HOPPER_BY_DEFAULT` is on, else `triton`. Off a GPU the XLA path (`reference`) runs
unless kernels are asked for, as for every op (`interpret=`, ``implementation="triton"``).
Decoding has no backward: a gradient through the kernels raises.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoftmax._core import pallas
from jaxsoftmax._core.backends import check_implementation
from jaxsoftmax._core.inputs import check_floating
from jaxsoftmax.attention.decode import mosaic_gpu, reference, triton
from jaxsoftmax.attention.logits import check_per_head
from jaxsoftmax.attention.masks import check_window

__all__ = ["decode_attention", "run_kernels", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = (None, "mosaic_gpu", "triton", "xla")
_OP = "decode_attention"
# Whether implementation=None takes the Hopper kernel on a Hopper GPU where it runs the
# call. Off: it passes its GPU tests on the H200 but is 1-10% slower than the Triton
# kernel on every shape of benchmarks/results/decode_attention.md.
# implementation="mosaic_gpu" runs it.
HOPPER_BY_DEFAULT = False


def _check(query, key, value, lengths, block_table):
  query = check_floating(query, "query", _OP)
  key = check_floating(key, "key", _OP)
  value = check_floating(value, "value", _OP)
  if query.ndim != 4:
    raise ValueError(f"{_OP}: query must be (B, T, N, H), got shape {query.shape}")
  B, T, N, H = query.shape
  if key.ndim != 4 or key.shape != value.shape:
    raise ValueError(f"{_OP}: key and value must share one 4-d shape ((B, S, K, H), or "
                     f"(pages, page_size, K, H) with a block_table), got {key.shape} and "
                     f"{value.shape}")
  if key.dtype != query.dtype or value.dtype != query.dtype:
    raise TypeError(f"{_OP}: key and value must have the dtype of query ({query.dtype}), "
                    f"got {key.dtype} and {value.dtype}")
  K = key.shape[2]
  if key.shape[3] != H:
    raise ValueError(f"{_OP}: key's head dim {key.shape[3]} differs from query's {H}")
  if N % K:
    raise ValueError(f"{_OP}: the query heads ({N}) must be a multiple of the KV heads "
                     f"({K})")
  lengths = jnp.asarray(lengths)
  if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"{_OP}: lengths must be an integer array of shape ({B},), got "
                     f"{lengths.dtype} {lengths.shape}")
  if block_table is None:
    if key.shape[0] != B:
      raise ValueError(f"{_OP}: a contiguous cache must have query's batch ({B}) first, "
                       f"got key {key.shape}")
    capacity = key.shape[1]
  else:
    block_table = jnp.asarray(block_table)
    if (block_table.dtype != jnp.int32 or block_table.ndim != 2
        or block_table.shape[0] != B):
      raise ValueError(f"{_OP}: block_table must be int32 of shape ({B}, max_pages), got "
                       f"{block_table.dtype} {block_table.shape}")
    capacity = block_table.shape[1] * key.shape[1]
  if not isinstance(lengths, jax.core.Tracer):
    concrete = np.asarray(lengths)
    if concrete.size and (concrete.min() < 0 or concrete.max() > capacity):
      raise ValueError(f"{_OP}: lengths must lie in [0, {capacity}] (the cache's "
                       f"positions per sequence), got {concrete.min()}..{concrete.max()}")
    if ((concrete > 0) & (concrete < T)).any():
      raise ValueError(f"{_OP}: a nonzero length must hold the {T} new tokens, got "
                       f"lengths {concrete.tolist()}")
  return query, key, value, lengths.astype(jnp.int32), block_table


def run_kernels(q, k, v, lengths, block_table, plan, *, scale: float,
                softcap: float | None = None, window_left: int | None = None,
                interpret: bool = False, sinks=None, out_dtype=jnp.float32):
  """(out in ``out_dtype``, lse float32), (B, T, N, H) and (B, T, N): the one sequence
  every caller of the kernels runs (this op, the `dot_product_attention` decode backend,
  the benchmark's and tests' own tiles): the kernel that ``plan`` names (a
  `mosaic_gpu.Plan`: the Hopper kernel; a `triton.DecodeDims`: the Triton kernel)
  writes each split's partial result, and `triton.merge` merges them in float32, the
  ``sinks`` (None or (B, N) float32) with them; one split without sinks is the result
  as the Triton kernel writes it (`triton.single_split`). No derivatives:
  `decode_attention` says why."""
  if isinstance(plan, mosaic_gpu.Plan):
    dims = plan.dims
    o, m, log2_l = mosaic_gpu.forward(q, k, v, lengths, block_table, plan=plan,
                                      scale=scale, softcap=softcap,
                                      window_left=window_left)
  else:
    dims = plan
    alone = dims.splits == 1 and sinks is None
    o, m, log2_l = triton.forward(q, k, v, lengths, block_table, dims=dims, scale=scale,
                                  softcap=softcap, window_left=window_left,
                                  interpret=interpret,
                                  o_dtype=out_dtype if alone else jnp.float32)
    if alone:
      return triton.single_split(o, m, log2_l, dims=dims, scale=scale, softcap=softcap,
                                 out_dtype=out_dtype)
  return triton.merge(o, m, log2_l, dims=dims, scale=scale, softcap=softcap, sinks=sinks,
                      out_dtype=out_dtype, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _kernels(q, k, v, lengths, block_table, sinks, plan, scale, softcap, window_left,
             interpret):
  """`run_kernels`, the output in the query's dtype, under a backward that raises."""
  return run_kernels(q, k, v, lengths, block_table, plan, scale=scale, softcap=softcap,
                     window_left=window_left, interpret=interpret, sinks=sinks,
                     out_dtype=q.dtype)


def _kernels_fwd(*args):
  return _kernels(*args), None


def _kernels_bwd(*_):
  raise NotImplementedError(
      f"{_OP} has no backward: decoding needs none. To differentiate attention over a "
      "cache, use dot_product_attention with key_value_seq_lengths, or "
      "implementation='xla' here.")


_kernels.defvjp(_kernels_fwd, _kernels_bwd)


def _backend(implementation, query, key, block_table, interpret: bool) -> str:
  """The kernel that runs a call: "mosaic_gpu" where it is asked for (a ValueError says
  why it cannot run the call), or where none is named and it can (with
  `HOPPER_BY_DEFAULT`); else "triton"."""
  if implementation == "triton" or (implementation is None and not HOPPER_BY_DEFAULT):
    return "triton"
  why = mosaic_gpu.unsupported(query, key, block_table, interpret=interpret)
  if implementation == "mosaic_gpu" and why is not None:
    raise ValueError(f"{_OP}: implementation='mosaic_gpu' cannot run this call: {why}")
  return "triton" if why is not None else "mosaic_gpu"


def decode_attention(query, key, value, lengths, *, block_table=None, scale=None,
                     logits_soft_cap=None, local_window_size=None,
                     num_splits: int | None = None, return_residual: bool = False,
                     implementation: str | None = None, interpret: bool | None = None,
                     sinks=None):
  """Attention of the T newest tokens of each sequence against its KV cache.

  Args:
    query: (B, T, N, H), bfloat16, float16 or float32: query t of sequence b sits at
      position ``lengths[b] - T + t`` and sees the cache positions up to its own (the
      new tokens causal among themselves).
    key, value: the cache: contiguous (B, S, K, H), or with ``block_table`` page pools
      (num_pages, page_size, K, H) where page j of sequence b is
      ``key[block_table[b, j]]``. K divides N (GQA, MQA).
    lengths: (B,) integers: the valid positions of each sequence, the T new ones
      included; 0 is an empty slot (output 0, lse -inf). Positions at or past a length
      are never read into the result.
    block_table: optional (B, max_pages) int32. Inside jit its indices cannot be
      checked: one outside the pool is clamped into it (never a read outside it).
    scale: the logits' scale, 1/sqrt(H) by default.
    logits_soft_cap: c > 0: logits c·tanh(logits / c).
    local_window_size: w or (w, right): each token sees the w positions before it and
      itself (right is the causal mask's, ignored).
    num_splits: splits of each sequence's cache over programs; None chooses from the
      batch, the heads and the GPU's SM count.
    return_residual: also return the float32 lse (B, T, N), to merge with other
      partial results (`merge_attention_states`).
    implementation: None (the kernels on a GPU: "mosaic_gpu" on a Hopper GPU where it
      runs the call and `HOPPER_BY_DEFAULT` is on, else "triton"; the XLA path
      elsewhere), "mosaic_gpu" (Hopper GPUs,
      bfloat16 and float16, head dims of multiples of 64 up to 256, T·G <= 64 query rows
      per KV head, page sizes that divide its block or are multiples of it: a ValueError
      says why where it cannot run the call), "triton", or "xla" (`reference`: plain
      jnp over the cache gathered into one array).
    interpret: run the kernels in Pallas interpret mode; see `jaxsoftmax.softmax`.
    sinks: optional attention sinks, (N,) floating: one logit per query head that joins
      each row's softmax without a value (gpt-oss), in the logits' units; they join the
      merge of the cache's splits. A sequence of length 0 then gives output 0 and lse =
      its sink.

  Returns:
    out (B, T, N, H) in query's dtype, and with ``return_residual`` also lse.
  """
  query, key, value, lengths, block_table = _check(query, key, value, lengths, block_table)
  check_implementation(_OP, implementation, IMPLEMENTATIONS)
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"{_OP}: logits_soft_cap must be > 0, got {logits_soft_cap!r}")
  if num_splits is not None and not (isinstance(num_splits, int) and num_splits > 0):
    raise ValueError(f"{_OP}: num_splits must be a positive int or None, got "
                     f"{num_splits!r}")
  sinks = check_per_head(sinks, query.shape[2], "sinks", "logit", _OP)
  window = check_window(local_window_size, _OP)
  window_left = None if window is None else window[0]  # the right is the causal mask's
  H = query.shape[-1]
  scale = float(1 / np.sqrt(H) if scale is None else scale)
  softcap = None if logits_soft_cap is None else float(logits_soft_cap)
  kernel_asked = implementation is not None or num_splits is not None
  if (implementation == "xla" or query.dtype == jnp.float64 or query.size == 0
      or key.size == 0 or pallas.xla_by_default(interpret, kernel_asked=kernel_asked)):
    out, lse = reference.decode_attention(query, key, value, lengths,
                                          block_table=block_table, scale=scale,
                                          logits_soft_cap=softcap, window_left=window_left,
                                          sinks=sinks)
  else:
    interpret = pallas.resolve_interpret(interpret)
    if _backend(implementation, query, key, block_table, interpret) == "mosaic_gpu":
      plan = mosaic_gpu.plan(query, key, block_table, num_splits, cores=pallas.num_cores())
    else:
      plan = triton.DecodeDims.of(query, key, block_table, num_splits,
                                  cores=pallas.num_cores())
    if sinks is not None:
      sinks = jnp.broadcast_to(sinks.astype(jnp.float32), (query.shape[0], query.shape[2]))
    query, key, value, lengths, block_table, sinks = pallas.vary_together(
        query, key, value, lengths, block_table, sinks)
    out, lse = _kernels(query, key, value, lengths, block_table, sinks, plan, scale,
                        softcap, window_left, interpret)
  return (out, lse) if return_residual else out
