"""Every op inside the JAX programs users bring: NaN in any input, x64 mode,
`jax.shard_map` with its default ``check_vma=True``, forward mode and second order (or
the clear error), and the XLA path a CPU takes by default. One table of ops; each test
runs on every entry, on the interpreted kernels here and, in its ``_gpu`` twin, on the
compiled ones (the Mosaic GPU kernels included, for 16-bit inputs on a Hopper GPU)."""

import functools
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import jaxsoftmax as js
from jaxsoftmax.attention import reference
from jaxprs import kernel_names
from tolerance import assert_same_derivatives

ON_GPU = jax.default_backend() == "gpu"
EPS = 1e-6


def _norm_ref(x, scale, bias, *, rms):
  x32 = x.astype(jnp.float32)
  if rms:
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + EPS) * scale[None]
  else:
    mean = jnp.mean(x32, -1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(jnp.var(x32, -1, keepdims=True) + EPS) * scale[None]
    y = y + bias[None]
  return y.astype(x.dtype)


def _attention_inputs(key, dtype, batch=2, T=19):
  kq, kk, kv = jax.random.split(key, 3)
  return (jax.random.normal(kq, (batch, T, 4, 64), dtype),
          jax.random.normal(kk, (batch, 19, 2, 64), dtype),
          jax.random.normal(kv, (batch, 19, 2, 64), dtype))


def _score_term_inputs(key, dtype, batch=2, T=19):
  """q, k, v with a key bias and a key mask (B, 1, 1, S), broadcast over the heads and
  queries (the derivative tests take one query); the mask keeps key 0, so that no row
  is without a key."""
  kb, km = jax.random.split(jax.random.fold_in(key, 1))
  q, k, v = _attention_inputs(key, dtype, batch, T)
  bias = jax.random.normal(kb, (batch, 1, 1, 19), dtype)
  mask = jax.random.bernoulli(km, 0.8, (batch, 1, 1, 19)).at[..., 0].set(True)
  return q, k, v, bias, mask


# Constants of the score-terms op: ALiBi slopes and sinks, one per query head.
SLOPES, SINKS = jnp.array([0.5, 0.25, 0.125, 0.0625]), jnp.array([-1.0, 0.0, 1.0, 2.0])


def _rows(key, dtype, rows=8):
  return (3 * jax.random.normal(key, (rows, 37))).astype(dtype)


def _labels(rows=8):
  return jnp.arange(rows) % 37


class Op:
  """One op of the table: ``inputs(key, dtype, rows)`` its arguments (the first is
  differentiated and gets the NaN), ``ours(*args, **kernel_options)``, ``theirs(*args)``
  the jax.nn / optax / Flax twin, and the PartitionSpecs of its arguments when their
  leading axis is sharded."""

  def __init__(self, inputs, ours, theirs, specs):
    self.inputs, self.ours, self.theirs, self.specs = inputs, ours, theirs, specs


ROWS, SHARED = PartitionSpec("x"), PartitionSpec()
OPS = {
    "softmax": Op(lambda k, d, r: (_rows(k, d, r),), js.softmax, jax.nn.softmax, (ROWS,)),
    "log_softmax": Op(lambda k, d, r: (_rows(k, d, r),), js.log_softmax, jax.nn.log_softmax,
                      (ROWS,)),
    "logsumexp": Op(lambda k, d, r: (_rows(k, d, r),),
                    lambda x, **kw: js.logsumexp(x, axis=-1, **kw),
                    lambda x: jax.nn.logsumexp(x, axis=-1), (ROWS,)),
    "cross_entropy": Op(
        lambda k, d, r: (_rows(k, d, r), _labels(r)),
        lambda x, y, **kw: js.cross_entropy(x, y, reduction="none", **kw),
        lambda x, y: optax.softmax_cross_entropy_with_integer_labels(
            x.astype(jnp.float32), y), (ROWS, ROWS)),
    "linear_cross_entropy": Op(
        lambda k, d, r: ((jax.random.normal(k, (r, 16))).astype(d),
                         jax.random.normal(jax.random.fold_in(k, 1), (16, 37)).astype(d),
                         _labels(r)),
        lambda h, w, y, **kw: js.linear_cross_entropy(h, w, y, reduction="none", **kw),
        lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(
            jnp.dot(h, w, preferred_element_type=jnp.float32), y), (ROWS, SHARED, ROWS)),
    "layer_norm": Op(
        lambda k, d, r: (_rows(k, d, r), jnp.linspace(0.5, 1.5, 37, dtype=jnp.float32),
                         jnp.linspace(-0.1, 0.1, 37, dtype=jnp.float32)),
        lambda x, s, b, **kw: js.layer_norm(x, s, b, epsilon=EPS, **kw),
        functools.partial(_norm_ref, rms=False), (ROWS, SHARED, SHARED)),
    "rms_norm": Op(
        lambda k, d, r: (_rows(k, d, r), jnp.linspace(0.5, 1.5, 37, dtype=jnp.float32)),
        lambda x, s, **kw: js.rms_norm(x, s, epsilon=EPS, **kw),
        lambda x, s: _norm_ref(x, s, None, rms=True), (ROWS, SHARED)),
    "dot_product_attention": Op(
        lambda k, d, r: _attention_inputs(k, d, r),
        lambda q, k, v, **kw: js.dot_product_attention(q, k, v, is_causal=True, **kw),
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
        (ROWS, ROWS, ROWS)),
    # A bias, a mask array, ALiBi slopes and sinks: the Triton kernels' score terms.
    "dot_product_attention score terms": Op(
        lambda k, d, r: _score_term_inputs(k, d, r),
        lambda q, k, v, bias, mask, **kw: js.dot_product_attention(
            q, k, v, bias, mask, is_causal=True, alibi_slopes=SLOPES, sinks=SINKS, **kw),
        lambda q, k, v, bias, mask: reference.dot_product_attention(
            q, k, v, bias, mask, is_causal=True, alibi_slopes=SLOPES, sinks=SINKS)[0],
        (ROWS, ROWS, ROWS, ROWS, ROWS)),
    # One new token per sequence against its keys: the decode kernel's calls.
    "dot_product_attention decode step": Op(
        lambda k, d, r: (*_attention_inputs(k, d, r, T=1), 19 - (jnp.arange(r) * 7) % 19),
        lambda q, k, v, n, **kw: js.dot_product_attention(q, k, v,
                                                          key_value_seq_lengths=n, **kw),
        lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n),
        (ROWS, ROWS, ROWS, ROWS)),
}
REVERSE_ONLY = ("linear_cross_entropy",)  # forward mode and second order: a clear error


def _kernels(interpret: bool) -> dict:
  """The options that run the kernels: interpreted on a CPU, compiled on a GPU."""
  return dict(interpret=interpret)


def _nan_patterns_match(got, want, what):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.isnan(np.asarray(g, np.float32)),
                                  np.isnan(np.asarray(w, np.float32)), err_msg=what)


def _scalar(outputs):
  return sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in jax.tree.leaves(outputs))


def _loss(fn):
  """A scalar of fn's outputs (differentiable in the first argument)."""
  return lambda first, *rest: _scalar(fn(first, *rest))


def _outputs_and_grad(fn, argnums=0):
  """fn's outputs (its forward alone, no derivative traced) and the gradient of their
  `_loss` (the forward of reverse mode and the backward), to run as one program."""
  return lambda *args: (fn(*args), jax.grad(_loss(fn), argnums=argnums)(*args))


@functools.cache
def _program(name, interpret: bool):
  """`_outputs_and_grad` of an op on the kernels, jitted once: the tests that run it on
  the same shapes (8 float32 rows, with a NaN or not) share one compiled program."""
  return jax.jit(_outputs_and_grad(functools.partial(OPS[name].ours, **_kernels(interpret))))


@pytest.mark.parametrize("name", OPS)
def test_nan_is_never_hidden(key, name, interpret=True, dtype=jnp.float32):
  # A NaN in the first input: NaN exactly where the twin has it, and in the gradient.
  op = OPS[name]
  first, *rest = op.inputs(key, dtype, 8)
  first = first.at[(3,) + (0,) * (first.ndim - 1)].set(jnp.nan)
  got, grad = _program(name, interpret)(first, *rest)
  _nan_patterns_match(got, op.theirs(first, *rest), name)
  assert np.isnan(np.asarray(grad, np.float32)).any(), f"{name}: the gradient hides NaN"


@pytest.mark.parametrize("where", ["query", "key", "value", "bias"])
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_attention_nan_in_every_input(key, where, implementation, interpret=True,
                                      dtype=jnp.float32):
  # NaN at position 3 of one input (for the bias, logit (3, 3)): the output and lse are
  # NaN where jax.nn's are, on the kernels and on the reference path; gradients too.
  q, k, v = _attention_inputs(key, dtype)
  bias = None
  if where == "bias":
    bias = jnp.zeros((2, 4, 19, 19), dtype).at[0, 0, 3, 3].set(jnp.nan)
  else:
    q, k, v = ((x.at[0, 3, 0, 0].set(jnp.nan) if n == where else x)
               for n, x in zip(("query", "key", "value"), (q, k, v)))
  ours = lambda q, k, v: js.dot_product_attention(
      q, k, v, bias, is_causal=True, implementation=implementation, return_residual=True,
      residual_dtype=jnp.float32, **_kernels(interpret))
  out, lse = ours(q, k, v)
  want = jax.nn.dot_product_attention(q, k, v, bias, is_causal=True)
  _nan_patterns_match(out, want, f"output, NaN in the {where}")
  assert np.isnan(np.asarray(lse)).any() == (where != "value")  # lse: of the logits only
  grads = jax.grad(lambda *a: jnp.sum(ours(*a)[0].astype(jnp.float32)), argnums=(0, 1, 2))(
      q, k, v)
  # (dV = Pᵀ dO does not read V: its NaN reaches dQ and dK.)
  assert any(np.isnan(np.asarray(g, np.float32)).any() for g in grads)


@pytest.mark.parametrize("name", OPS)
def test_x64_mode(key, name, interpret=True, dtype=jnp.float32):
  # jax_enable_x64 changes the default integer and float types around the kernels (their
  # indices, Python scalars, lengths), not the results on float32 inputs.
  op = OPS[name]
  args = op.inputs(key, dtype, 8)
  want, _ = _program(name, interpret)(*args)
  with jax.enable_x64(True):  # the same function, traced again under x64
    got, grad = _program(name, interpret)(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=2e-6, atol=2e-6)
  assert np.isfinite(np.asarray(grad, np.float32)).all()


def _sharded(name, mesh, options):
  """The op inside jax.shard_map (check_vma=True, the default) over the mesh axis "x",
  and the global inputs placed for it."""
  op = OPS[name]
  ours = functools.partial(op.ours, **options)
  out_spec = ROWS
  return jax.shard_map(ours, mesh=mesh, in_specs=op.specs, out_specs=out_spec), op


def _placed(mesh, op, args):
  return tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, op.specs))


@pytest.mark.parametrize("name", OPS)
def test_shard_map_with_check_vma(key, name, monkeypatch):
  # On the 8 CPU devices: the XLA path runs sharded and matches one device; the kernels
  # (interpret=False, which needs a GPU to run) trace, forward and backward, with their
  # outputs' varying axes declared and an unsharded weight's gradient summed. Pallas'
  # interpreter itself fails under check_vma (docs/numerics.md, "What runs where").
  monkeypatch.delenv("JAXSOFTMAX_INTERPRET", raising=False)
  mesh = jax.make_mesh((8,), ("x",))
  op = OPS[name]
  args = op.inputs(key, jnp.float32, 16)
  local, _ = _sharded(name, mesh, {})
  placed = _placed(mesh, op, args)
  # The outputs and gradients, sharded and on one device: a program each.
  (got, grads), (want, want_grads) = (
      jax.jit(_outputs_and_grad(fn, argnums=_float_args(args)))(*a)
      for fn, a in ((local, placed), (op.ours, args)))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
  kernels, _ = _sharded(name, mesh, dict(interpret=False))
  for dtype in (jnp.float32, jnp.bfloat16):  # the 16-bit paths too (a chunked backward)
    placed = _placed(mesh, op, op.inputs(key, dtype, 16))
    jax.jit(kernels).trace(*placed)
    jax.jit(jax.grad(_loss(kernels), argnums=_float_args(args))).trace(*placed)


def _float_args(args) -> tuple[int, ...]:
  return tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))


# The score terms' forward mode is test_attention.py's (test_forward_mode, with a bias and
# sinks), and so is their second order (test_second_order_with_score_terms).
@pytest.mark.parametrize("name", [n for n in OPS if n not in (
    "softmax", "log_softmax", "logsumexp", "cross_entropy", "dot_product_attention score terms")])
def test_forward_mode_and_second_order(key, name, interpret=True):
  # jax.jvp, jacfwd, jvp-of-grad and hessian as the twin's (the softmax family and
  # cross_entropy have theirs in their own modules), or the clear error.
  op = OPS[name]
  attention = name.startswith("dot_product_attention")
  first, *rest = op.inputs(key, jnp.float32, 1 if attention else 4)
  # Interpreted, the attention at head dim 16, the kernels' smallest tile (as in
  # test_attention.py's forward mode): a quarter of the tangents; the compiled twin
  # keeps 64.
  if attention and interpret:
    first, *rest = (a[..., :16] if a.ndim == 4 else a for a in (first, *rest))
  # Under jax.jit, as in a training step: each transform one program, not its operations
  # one by one.
  ours = jax.jit(lambda x: _loss(functools.partial(op.ours, **_kernels(interpret)))(x, *rest))
  theirs = jax.jit(lambda x: _loss(op.theirs)(x, *rest))
  if name in REVERSE_ONLY:
    for transform in (lambda f: jax.jvp(f, (first,), (first,)), lambda f: jax.hessian(f)(first),
                      lambda f: jax.jvp(jax.grad(f), (first,), (first,))):
      with pytest.raises(NotImplementedError, match="reverse mode .* only"):
        transform(ours)
    return
  # The attention's jacobian and Hessian at one query of two heads, one per K/V head (of
  # 19 keys): 2 x head dim tangents, which the tangent kernel takes as a batch (32 x 32
  # Hessian entries interpreted); jax.jvp and jvp-of-grad take all four heads, two to a
  # K/V head.
  one_query = first[:, :1, :2] if attention else None
  assert_same_derivatives(ours, theirs, first, hessian_at=one_query, jacobian_at=one_query)


def test_ring_attention_reverse_mode_only(key):
  mesh = jax.make_mesh((2,), ("sp",), devices=jax.devices()[:2])
  spec = PartitionSpec(None, "sp")
  q, k, v = _attention_inputs(key, jnp.float32)
  q, k, v = (jax.device_put(x[:, :18], NamedSharding(mesh, spec)) for x in (q, k, v))
  ring = jax.shard_map(functools.partial(js.ring_attention, axis_name="sp", is_causal=True),
                       mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
  loss = jax.jit(lambda q, k, v: jnp.sum(ring(q, k, v)))
  with jax.set_mesh(mesh):  # the scalar loss lives on the mesh
    assert np.isfinite(jax.grad(loss)(q, k, v)).all()
    for transform in (lambda: jax.jvp(loss, (q, k, v), (q, k, v)),
                      lambda: jax.hessian(loss)(q, k, v)):
      with pytest.raises(NotImplementedError, match="ring_attention is differentiable in "
                                                    "reverse mode"):
        transform()


@pytest.mark.parametrize("name", OPS)
def test_xla_path_by_default_off_a_gpu(key, name, monkeypatch):
  # Without a GPU and without a request for the kernels, no Pallas kernel runs: the XLA
  # path, with the kernels' results (here interpreted) to rounding.
  if ON_GPU:
    pytest.skip("on a GPU the default is the compiled kernels")
  monkeypatch.delenv("JAXSOFTMAX_INTERPRET", raising=False)
  op = OPS[name]
  args = op.inputs(key, jnp.float32, 8)
  # The program traced once: its jaxpr runs no kernel, and it is what runs.
  traced = jax.jit(jax.value_and_grad(_loss(op.ours))).trace(*args)
  assert kernel_names(traced.jaxpr.jaxpr) == []
  value, grad = traced.lower().compile()(*args)
  outputs, want_grad = _program(name, True)(*args)
  want_value = _scalar(outputs)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-5)


def test_xla_path_is_fast_on_a_cpu(monkeypatch):
  # What took 88 s (softmax) and 257 s (the gradient of cross_entropy) interpreted.
  if ON_GPU:
    pytest.skip("on a GPU the default is the compiled kernels")
  monkeypatch.delenv("JAXSOFTMAX_INTERPRET", raising=False)
  x = jax.random.normal(jax.random.PRNGKey(0), (2048, 32000))
  labels = jnp.arange(2048) % 32000
  start = time.perf_counter()
  jax.block_until_ready(js.softmax(x))
  jax.block_until_ready(jax.grad(lambda x: js.cross_entropy(x, labels))(x))
  assert time.perf_counter() - start < 30


def test_naming_a_kernel_runs_it_off_a_gpu(monkeypatch):
  # A tiling or a kernel backend asks for the kernels: interpreted off a GPU.
  monkeypatch.delenv("JAXSOFTMAX_INTERPRET", raising=False)
  x = jnp.ones((4, 40))
  softmax = functools.partial(js.softmax, tiling=js.RowTiling("online", 1, 16))
  assert kernel_names(jax.make_jaxpr(softmax)(x).jaxpr) == ["softmax_online"]
  q = jnp.ones((1, 8, 2, 16))
  assert js.attention_kernels(q, q, q, implementation="triton") == ("triton", "triton")
  if not ON_GPU:
    assert js.attention_kernels(q, q, q) == ("xla", "xla")


def test_errors_name_the_argument():
  q = jnp.zeros((2, 8, 4, 16))
  with pytest.raises(ValueError, match=r"mask of shape \(3, 5\) must broadcast to"):
    js.dot_product_attention(q, q, q, mask=jnp.ones((3, 5), bool))
  with pytest.raises(ValueError, match=r"bias of shape \(2, 4, 8, 9\) must broadcast"):
    js.dot_product_attention(q, q, q, bias=jnp.zeros((2, 4, 8, 9)))
  with pytest.raises(ValueError, match=r"merge_states: .* m_b \(4,\)"):
    js.merge_states(jnp.zeros(3), jnp.ones(3), jnp.zeros(4), jnp.ones(4))
  mesh = jax.make_mesh((2,), ("sp",))
  with pytest.raises(ValueError, match=r"query must have rank 4 \(B, T, N, H\)"):
    js.context_parallel_attention(q[0], q[0], q[0], mesh=mesh, axis_name="sp")


# --- Flax ------------------------------------------------------------------------------


def _mha(attention_fn=None):
  """nnx's attention layer on ``attention_fn`` (None: Flax's own)."""
  from flax import nnx
  options = {} if attention_fn is None else dict(attention_fn=attention_fn)
  return nnx.MultiHeadAttention(num_heads=2, in_features=32, qkv_features=32, decode=False,
                                rngs=nnx.Rngs(0), **options)


def test_flax_attention_fn_options_stick(key):
  # nnx passes is_causal=False on every call: flax_attention_fn(is_causal=True) is causal
  # anyway; the layer's own is_causal=True also reaches the kernels.
  x = jax.random.normal(key, (2, 11, 32))
  causal = _mha()(x, is_causal=True)
  fixed = _mha(js.flax_attention_fn(is_causal=True, implementation="triton"))(x)
  per_call = _mha(js.flax_attention)(x, is_causal=True)
  np.testing.assert_allclose(fixed, causal, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(per_call, causal, rtol=2e-5, atol=2e-5)
  with pytest.raises(TypeError, match="nnx's to pass"):
    js.flax_attention_fn(mask=None)


def test_flax_masks(key):
  # A concrete causal mask (nnx.make_causal_mask) becomes is_causal=True; any other mask
  # reaches the kernels as it is, silently, and gives nnx's output on every row that
  # has a key (a row without one gives 0 where nnx averages the values).
  from flax import nnx
  x = jax.random.normal(key, (2, 11, 32))
  layer = _mha(js.flax_attention_fn(implementation="triton", interpret=True))
  causal = nnx.make_causal_mask(x[..., 0])
  padding = jnp.broadcast_to(
      nnx.make_attention_mask(jnp.arange(11) < 7, jnp.arange(11) < 7), (2, 1, 11, 11))
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    got_causal = layer(x, mask=causal)
    got_padding = layer(x, mask=padding)
    kernels = js.attention_kernels(*(jnp.zeros((2, 11, 2, 16)),) * 3, mask=padding > 0,
                                   implementation="triton", interpret=True)
  np.testing.assert_allclose(got_causal, _mha()(x, is_causal=True), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(got_padding[:, :7], _mha()(x, mask=padding)[:, :7], rtol=2e-5,
                             atol=2e-5)
  assert kernels == ("triton", "triton")


def test_flax_mask_array_with_gradients(key):
  # A mask that is neither causal nor a padded batch's (holes, a head axis: documents
  # that differ per head) reaches the Triton kernels as a mask array, traced under
  # nnx.jit: the layer's output and the gradients of its parameters and input are
  # nnx's own (every row keeps its diagonal key, so none is empty).
  from flax import nnx
  x = jax.random.normal(key, (2, 11, 32))
  holes = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.7, (2, 2, 11, 11))
  mask = holes | jnp.eye(11, dtype=bool)[None, None]
  ours = _mha(js.flax_attention_fn(implementation="triton", interpret=True))
  theirs = _mha()
  kernels = js.attention_kernels(*(jnp.zeros((2, 11, 2, 16)),) * 3, mask=mask,
                                 implementation="triton", interpret=True)
  assert kernels == ("triton", "triton")

  def loss(layer, x):
    return jnp.sum(jnp.sin(layer(x, mask=mask)))

  got, want = (nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(layer, x)
               for layer in (ours, theirs))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_flax_traced_padded_causal_mask_runs_as_lengths(key):
  # Inside jax.jit nnx's padding and causal masks, combined, are traced: the kernels take
  # them as lengths with is_causal (`api._mask_as_lengths`), the same program to the bit
  # as the layer given those lengths and is_causal itself.
  from flax import nnx
  x = jax.random.normal(key, (2, 11, 32))
  lengths = jnp.array([11, 7])
  tokens = jnp.arange(11)[None, :] < lengths[:, None]
  mask = nnx.combine_masks(nnx.make_attention_mask(tokens, tokens),
                           nnx.make_causal_mask(tokens))
  options = dict(implementation="triton", interpret=True)
  masked = _mha(js.flax_attention_fn(**options))
  fixed = _mha(js.flax_attention_fn(is_causal=True, query_seq_lengths=lengths,
                                    key_value_seq_lengths=lengths, **options))
  got = jax.jit(lambda x, mask: masked(x, mask=mask))(x, mask)
  np.testing.assert_array_equal(got, jax.jit(lambda x: fixed(x))(x))
  np.testing.assert_allclose(got[1, :7], _mha()(x, mask=mask)[1, :7], rtol=2e-5, atol=2e-5)


def test_nnx_norms_take_a_residual(key):
  from flax import nnx
  x, r = jax.random.normal(key, (2, 3, 16)), jax.random.normal(jax.random.fold_in(key, 1),
                                                               (2, 3, 16))
  for ours, theirs in ((js.nnx.LayerNorm, nnx.LayerNorm), (js.nnx.RMSNorm, nnx.RMSNorm)):
    y, h = ours(16, rngs=nnx.Rngs(0))(x, residual=r)
    np.testing.assert_allclose(h, x + r, rtol=1e-6)
    np.testing.assert_allclose(y, theirs(16, rngs=nnx.Rngs(0))(x + r), rtol=2e-5, atol=2e-5)


def test_nnx_is_an_attribute_after_import():
  # A fresh interpreter: nnx is loaded on first use of js.nnx, not before.
  script = ("import sys, jaxsoftmax as js; assert 'jaxsoftmax.nnx' not in sys.modules;"
            "print(js.nnx.LayerNorm.__name__)")
  run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True)
  assert run.stdout.strip() == "LayerNorm"


# --- the compiled kernels ----------------------------------------------------------------


# Each GPU twin in float32 (Triton kernels) and bfloat16 (Mosaic GPU ones on a Hopper GPU).
gpu_dtypes = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                                     ids=["float32", "bfloat16"])


@pytest.mark.gpu
@gpu_dtypes
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("check", [test_nan_is_never_hidden, test_x64_mode],
                         ids=["nan_is_never_hidden", "x64_mode"])
def test_every_op_gpu(key, check, name, dtype):
  # The CPU tests above of every op, on the compiled kernels.
  check(key, name, interpret=False, dtype=dtype)


@pytest.mark.gpu
@gpu_dtypes
@pytest.mark.parametrize("where", ["query", "key", "value", "bias"])
def test_attention_nan_in_every_input_gpu(key, where, dtype):
  test_attention_nan_in_every_input(key, where, None, interpret=False, dtype=dtype)


@pytest.mark.gpu
@gpu_dtypes
@pytest.mark.parametrize("name", OPS)
def test_shard_map_with_check_vma_gpu(key, name, dtype):
  # The compiled kernels inside shard_map(check_vma=True) on a mesh of every GPU, forward
  # and backward, against one unsharded call.
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  op = OPS[name]
  args = op.inputs(key, dtype, 8 * jax.device_count())
  local, _ = _sharded(name, mesh, {})
  placed = _placed(mesh, op, args)
  for got, want in zip(jax.tree.leaves(jax.jit(local)(*placed)),
                       jax.tree.leaves(op.ours(*args))):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2)
  floats = _float_args(args)
  grads = jax.jit(jax.grad(_loss(local), argnums=floats))(*placed)
  want = jax.grad(_loss(op.ours), argnums=floats)(*args)
  for g, w in zip(grads, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in OPS if n not in ("softmax", "log_softmax",
                                                               "logsumexp", "cross_entropy")])
def test_forward_mode_and_second_order_gpu(key, name):
  # The twins' float32 products in full float32, not the GPU's default TF32.
  with jax.default_matmul_precision("float32"):
    test_forward_mode_and_second_order(key, name, interpret=False)
