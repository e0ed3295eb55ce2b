"""The portable backend: FlashAttention-2 forward and backward kernels through Pallas'
Triton lowering. Runs on any recent NVIDIA GPU, and interpreted on any device; every
feature of `dot_product_attention`: the position masks, a value head dim other than the
query's (``Hv != H``), and the score terms read by tiles (``bias`` with its gradient,
``mask`` arrays, whose fully masked tiles are skipped, and ALiBi slopes)."""

from __future__ import annotations

from jaxsoftmax.attention.call import Call
from jaxsoftmax.attention.triton import backward as _backward
from jaxsoftmax.attention.triton import forward as _forward
from jaxsoftmax.attention.triton import tangent as _tangent
from jaxsoftmax.attention.triton.tiling import BlockSizes

NAME = "triton"
MAX_HEAD_DIM = 256


def unsupported(call: Call) -> str | None:
  """Why this backend cannot run ``call``, or None when it can."""
  if call.block_sizes is not None and not isinstance(call.block_sizes, BlockSizes):
    return (f"block_sizes is a {type(call.block_sizes).__name__}; the Triton kernels "
            "take jaxsoftmax.BlockSizes")
  if max(call.H, call.Hv) > MAX_HEAD_DIM:
    return f"head dims up to {MAX_HEAD_DIM}, got {call.H} (query, key), {call.Hv} (value)"
  return None


def blocks(call: Call) -> BlockSizes:
  """The caller's Triton tiles, else the defaults for the call's shape (for the wider of
  the two head dims, whose tiles take the most registers)."""
  if isinstance(call.block_sizes, BlockSizes):
    return call.block_sizes
  return BlockSizes.default(call.T, call.S, max(call.H, call.Hv), call.dtype,
                            call.spec.is_causal)


def fwd(q, k, v, aux_arrays, call: Call, *, float32_output: bool, sinks=None):
  """(o, m, log2_l[, o in float32]): see `triton.forward.forward`."""
  return _forward.forward(q, k, v, aux_arrays, spec=call.spec, blocks=blocks(call),
                          scale=call.scale, softcap=call.softcap,
                          interpret=call.interpret, float32_output=float32_output,
                          sinks=sinks)


def backward_unsupported(call: Call) -> str | None:
  """None: this backward differentiates every forward's residuals, deterministically
  (but for a broadcast bias's gradient, added atomically unless ``call.deterministic``)."""
  del call
  return None


def bwd(q, k, v, o, m, log2_l, do, aux_arrays, call: Call, *, grad_dtype=None,
        delta=None, with_dbias: bool = False):
  """(dq, dk, dv) from any backend's forward residuals, and with ``with_dbias`` the
  bias's gradient; see `triton.backward`."""
  return _backward.backward(q, k, v, o, m, log2_l, do, aux_arrays, spec=call.spec,
                            blocks=blocks(call), scale=call.scale, softcap=call.softcap,
                            interpret=call.interpret, grad_dtype=grad_dtype, delta=delta,
                            with_dbias=with_dbias, deterministic=call.deterministic)


def jvp(q, k, v, o, m, log2_l, tangents, aux_arrays, call: Call):
  """The output's tangent for ``tangents`` (q̇, k̇, v̇[, the bias's]) from any backend's
  forward residuals; see `triton.tangent`."""
  q_dot, k_dot, v_dot, *bias_dot = tangents
  return _tangent.tangent(q, k, v, o, m, log2_l, q_dot, k_dot, v_dot, aux_arrays,
                          spec=call.spec, blocks=blocks(call), scale=call.scale,
                          softcap=call.softcap, interpret=call.interpret,
                          bias_dot=bias_dot[0] if bias_dot else None)


__all__ = ["NAME", "BlockSizes", "unsupported", "fwd", "backward_unsupported", "bwd", "jvp"]
