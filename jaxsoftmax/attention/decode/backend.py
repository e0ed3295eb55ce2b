"""The decode kernel as a `dot_product_attention` backend (``implementation="decode"``),
so that a model calling the jax.nn-style function while it decodes gets it unchanged.

It runs the calls that are decodes: one query token per sequence (T = 1) that sees
every key below its length (``key_value_seq_lengths``, else all S), with no causal mask
(jax.nn aligns it with the first key, not the last), window or segment ids. There the
training forward tiles 64 or more query rows per program for one row of work; the
flash-decoding kernel (`decode.triton`) reads the cache at 90-100% of the read bandwidth
on contiguous caches (benchmarks/results/README.md, "decode_attention").

Its residuals are the training forward's: the merged lse in natural units becomes
(m, log2 l) = (lse / factor, 0), which `logits.lse` maps back, so the Triton backward
differentiates it (`api.select_backward`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxsoftmax._core import pallas
from jaxsoftmax.attention.call import Call
from jaxsoftmax.attention.decode import triton
from jaxsoftmax.attention.decode.api import run_kernels
from jaxsoftmax.attention.logits import Logits
from jaxsoftmax.attention.triton import MAX_HEAD_DIM

NAME = "decode"


def unsupported(call: Call) -> str | None:
  """Why ``call`` is not a decode this backend runs, or None when it is."""
  spec = call.spec
  if call.T != 1:
    return f"it runs one query token per sequence (a decode step), got T={call.T}"
  if spec.is_causal:
    return ("a causal mask aligns the one query with the first key (top-left, as "
            "jax.nn), which is not a decode; key_value_seq_lengths is")
  if spec.window_left is not None or spec.window_right is not None:
    return "local_window_size aligns with the first key; decode_attention takes windows"
  if spec.has_segments:
    return "it takes no segment_ids"
  if call.block_sizes is not None:
    return "block_sizes tune the training kernels; the decode kernel takes none"
  if call.H > MAX_HEAD_DIM:
    return f"head dims up to {MAX_HEAD_DIM}, got {call.H}"
  if call.score_terms:
    return f"{', '.join(call.score_terms)} run in the Triton kernels"
  if call.Hv != call.H:
    return (f"one head dim for query, key and value; got {call.H} (query, key) and "
            f"{call.Hv} (value)")
  return None


def fwd(q, k, v, aux_arrays, call: Call, *, float32_output: bool, sinks=None):
  """(o, m, log2_l[, o in float32]) of a decode call, the statistics (B, N, 1);
  ``sinks`` join the splits' merge (`api.run_kernels`)."""
  B, S = q.shape[0], k.shape[1]
  lengths = aux_arrays.kv_lengths
  lengths = jnp.full((B,), S, jnp.int32) if lengths is None else jnp.minimum(lengths, S)
  if aux_arrays.q_lengths is not None:  # a query length of 0: no query, output 0
    lengths = jnp.where(aux_arrays.q_lengths > 0, lengths, 0)
  lengths = jnp.maximum(lengths, 0)
  dims = triton.DecodeDims.of(q, k, None, None, cores=pallas.num_cores())
  out, lse = run_kernels(q, k, v, lengths, None, dims, scale=call.scale,
                         softcap=call.softcap, interpret=call.interpret, sinks=sinks,
                         out_dtype=jnp.float32 if float32_output else q.dtype)
  factor = Logits(call.scale, call.softcap, fused=False).factor
  m = jnp.transpose(lse, (0, 2, 1)) / factor  # -inf (no key) and NaN stay what they are
  stats = (m, jnp.zeros_like(m))
  o = out.astype(q.dtype)
  return (o, *stats, out) if float32_output else (o, *stats)


def backward_unsupported(call: Call) -> str | None:
  """Always a reason: `api.select_backward` then takes the Triton backward."""
  del call
  return "the decode kernel has no backward of its own; the Triton backward takes its residuals"


__all__ = ["NAME", "unsupported", "fwd", "backward_unsupported"]
