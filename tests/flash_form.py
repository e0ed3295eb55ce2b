"""The attention reference's gradients formed as the kernels form them: the second
reference of the 2x rule for attention (docs/testing.md, "Where the rule needs a second
reference"), shared by tests/test_attention.py and tests/test_ring_attention.py."""

import jax
import jax.numpy as jnp

from jaxsoftmax.attention import reference
from jaxsoftmax.attention.logits import score_grad_terms


def flash_form_gradients(q, k, v, do, *, bias=None, sinks=None, grad_bias=False,
                         grad_sinks=False, **options):
  """The reference's (output, lse, dq, dk, dv[, dbias][, dsinks]) in the inputs' dtype,
  with the gradients formed as FlashAttention's backward forms them (docs/testing.md,
  "Where the rule needs a second reference"): dS = P ∘ (dP - delta) with
  delta = rowsum(dO ∘ O) from the output before its rounding, where autodiff of the
  reference forms delta as rowsum(P ∘ dP) from the same dP; and dS enters the products
  with q and k as the kernels' tensor-core operands (`logits.score_grad_terms`: rounded
  to bfloat16 for bfloat16 inputs). dS is the gradient of
  <dO, P V> - Σ delta · (rowsum P + P_sink) in the logits, with P = exp(logits - lse)
  and lse and delta held fixed."""
  o, lse = reference.dot_product_attention(q, k, v, bias, sinks=sinks, **options)
  B, T, N = lse.shape
  K = k.shape[2]
  acc = jnp.promote_types(q.dtype, jnp.float32)  # as the reference's
  logits, logits_vjp = jax.vjp(
      lambda q, k, bias: reference.attention_logits(q, k, bias, **options), q, k, bias)
  sink_logits = lambda sinks: jnp.broadcast_to(sinks, (B, N)).reshape(
      B, K, N // K).astype(acc)[..., None]
  # lse in the logits' dtype (the reference returns it in float32); rows with no allowed
  # key have P = 0 whatever the stand-in for their -inf.
  row_lse = jax.nn.logsumexp(logits, axis=-1)
  if sinks is not None:
    row_lse = jnp.logaddexp(row_lse, sink_logits(sinks))
  row_lse = jnp.where(jnp.isfinite(row_lse), row_lse, 0)

  def output(logits, v):  # (B, K, G, T, H) in the logits' dtype, before any rounding
    p = jnp.exp(logits - row_lse[..., None])
    return p, jnp.einsum("bkgts,bskh->bkgth", p.astype(v.dtype), v,
                         preferred_element_type=acc, precision=jax.lax.Precision.HIGHEST)

  grouped_do = do.astype(acc).reshape(B, T, K, N // K, -1).transpose(0, 2, 3, 1, 4)
  # delta from the output before its rounding to the inputs' dtype, as the kernels'.
  delta = jnp.sum(grouped_do * output(logits, v)[1], axis=-1)

  def objective(logits, v, sinks):
    p, out = output(logits, v)
    rows = jnp.sum(p, axis=-1)
    if sinks is not None:
      rows = rows + jnp.exp(sink_logits(sinks) - row_lse)
    return jnp.sum(grouped_do * out) - jnp.sum(delta * rows)

  ds, dv, dsinks = jax.grad(objective, (0, 1, 2))(logits, v, sinks)
  operand = sum(t.astype(acc) for t in score_grad_terms(ds, q.dtype))
  dq, dk, _ = logits_vjp(operand)
  grads = [dq, dk, dv]
  if grad_bias:
    grads.append(logits_vjp(ds)[2])  # the kernels sum dbias from dS in float32
  if grad_sinks:
    grads.append(dsinks)
  return (o, lse, *grads)
