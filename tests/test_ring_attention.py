"""Context-parallel attention (`ring_attention`, `context_parallel_attention`): on the
CPU's 8 virtual devices (conftest) with the kernels interpreted, and on two GPUs.

Outputs and gradients of the sharded computation are checked against the float64 truth
of single-device attention under the 2x rule (tests/tolerance.py), on sequences whose
shards are multiples of no kernel block.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoftmax as js
from jaxsoftmax.attention import reference
from flash_form import flash_form_gradients
from tolerance import assert_2x_or_kernel_form, max_errors, truth

ON_GPU = jax.default_backend() == "gpu"


def _mesh(shards: int):
  if len(jax.devices()) < shards:
    pytest.skip(f"needs {shards} devices, has {len(jax.devices())}")
  return jax.make_mesh((shards,), ("sp",), devices=jax.devices()[:shards])


def _inputs(key, B, T, N, K, H, dtype):
  kq, kk, kv, kd = jax.random.split(key, 4)
  normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype)
  return (normal(kq, (B, T, N, H)), normal(kk, (B, T, K, H)), normal(kv, (B, T, K, H)),
          normal(kd, (B, T, N, H)))


def _check(key, shards, *, B=1, T=96, N=2, K=1, H=16, dtype=jnp.bfloat16, segments=False,
           is_causal=False, local_window_size=None, logits_soft_cap=None, sinks=None,
           **options):
  """Output and (dq, dk, dv, and dsinks with ``sinks``) of context-parallel attention over
  ``shards`` devices against the float64 truth; returns the kernel's errors."""
  q, k, v, do = _inputs(key, B, T, N, K, H, dtype)
  seg = None
  if segments:
    seg = jnp.sort(jax.random.randint(jax.random.fold_in(key, 1), (B, T), 0, 3), axis=1)
  masks = dict(is_causal=is_causal, local_window_size=local_window_size,
               logits_soft_cap=logits_soft_cap)
  inputs = (q, k, v) if sinks is None else (q, k, v, sinks)

  def run(attention, *args):
    o, vjp = jax.vjp(attention, *args[:-1])
    return (o, *vjp(args[-1]))

  ours = lambda q, k, v, *sinks: js.context_parallel_attention(
      q, k, v, mesh=_mesh(shards), axis_name="sp", segment_ids=seg, interpret=not ON_GPU,
      sinks=sinks[0] if sinks else None, **masks, **options)
  ref = lambda q, k, v, *sinks: reference.dot_product_attention(
      q, k, v, q_segments=seg, kv_segments=seg, sinks=sinks[0] if sinks else None,
      **masks)[0]
  got = run(ours, *inputs, do)
  in_dtype = jax.jit(functools.partial(run, ref))(*inputs, do)
  exact = truth(functools.partial(run, ref), *inputs, do)
  names = ("output", "dq", "dk", "dv", "dsinks")
  # As the attention tests: a gradient that misses the rule is measured once more
  # against the reference's gradients formed as the kernels form them.
  flash = functools.cache(lambda: jax.jit(functools.partial(
      flash_form_gradients, q_segments=seg, kv_segments=seg, grad_sinks=sinks is not None,
      **masks))(q, k, v, do, sinks=sinks))
  for i, (what, a, b, c) in enumerate(zip(names, got, in_dtype, exact)):
    assert_2x_or_kernel_form(a, b, c, what=what, kernel_form=(  # flash: o, lse, dq, ...
        None if what == "output" else lambda i=i: flash()[i + 1]))
  return [max_errors(a, c)[0] for a, c in zip(got, exact)]


# Of the eight (strategy, layout, mask) plans (`_RingPlan.ring_step`, `tiled_step`,
# `gathered`), those no other test here runs; each value of each axis is among them. The
# others: ring zigzag causal in test_error_does_not_grow_with_devices (8 devices),
# all_gather zigzag causal in test_gqa_segments_soft_cap_sinks, ring contiguous causal in
# test_other_dtypes; contiguous full is, for either strategy, the zigzag full plan (every
# block unmasked), and test_local_windows_across_shards runs the contiguous non-causal
# layout, with a window, on both.
@pytest.mark.parametrize("strategy, layout, is_causal", [
    # The ring's non-causal zigzag steps: every step its own block, unmasked.
    pytest.param("ring", "zigzag", False, id="ring-zigzag-full"),
    # Gathered zigzag without a mask: one piece over all keys, on every device alike.
    pytest.param("all_gather", "zigzag", False, id="all_gather-zigzag-full"),
    # Gathered contiguous causal: a causal band at each device's offset (a switch on it).
    pytest.param("all_gather", "contiguous", True, id="all_gather-contiguous-causal"),
])
def test_matches_single_device(key, strategy, layout, is_causal):
  # 4 devices, 24 tokens each (zigzag: two chunks of 12).
  _check(key, 4, strategy=strategy, layout=layout, is_causal=is_causal)


def test_error_does_not_grow_with_devices(key):
  # The same causal problem on 1 and 8 devices (4 elsewhere): partial results merge in
  # float32, so the error against the truth stays that of one device.
  errors = {P: _check(key, P, layout="zigzag", is_causal=True) for P in (1, 8)}
  for P, errs in errors.items():
    for what, err, err_1 in zip(("output", "dq", "dk", "dv"), errs, errors[1]):
      assert err <= 1.5 * err_1 + 1e-6, (P, what, err, err_1)


# GQA, packed segments (each batch row its own), a soft cap and sinks in one call: they
# reach the kernels alike after either strategy, so one, all_gather (also this file's
# zigzag causal all_gather plan). The ring's own part, segment ids travelling with K and
# V, is test_xla_blocks[ring]'s plan (these shapes, segments and soft cap on XLA's
# blocks); its zigzag causal kernels run in test_error_does_not_grow_with_devices.
def test_gqa_segments_soft_cap_sinks(key):
  # The sinks join the merged result on every device (the same code after either
  # strategy); dsinks sums over the devices.
  _check(key, 4, B=2, N=4, K=2, segments=True, logits_soft_cap=3.0, is_causal=True,
         layout="zigzag", strategy="all_gather", sinks=jnp.linspace(-2.0, 3.0, 4))


# Each window once, each strategy: the ring shifts a window's band by ±s·24 at step s,
# the gather by d·24 on device d, both through `_band`.
@pytest.mark.parametrize("strategy, window", [
    # Causal, reaching left into the previous shard: the ring's steps 2 and 3 hold no
    # pair on any device (steps with no kernel).
    pytest.param("ring", (20, 0), id="ring-(20, 0)"),
    # Past the neighbouring shards both ways: unmasked, left-only, right-only and empty
    # blocks among the ring's steps.
    pytest.param("ring", (40, 40), id="ring-(40, 40)"),
    # Right into the next shard: two-sided and left-only bands over the gathered keys.
    pytest.param("all_gather", (7, 30), id="all_gather-(7, 30)"),
])
def test_local_windows_across_shards(key, strategy, window):
  # Windows that reach into the neighbouring shards (24 tokens each), and past them.
  _check(key, 4, strategy=strategy, local_window_size=window, is_causal=window[1] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["float32", "float16"])
def test_other_dtypes(key, dtype):
  # Also the ring's contiguous causal plan: blocks of earlier devices whole, of later
  # ones empty.
  _check(key, 2, dtype=dtype, is_causal=True)


def test_batch_and_heads_sharded_too(key):
  # Data, tensor and sequence parallelism at once: a (2, 2, 2) mesh of the 8 devices.
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((2, 2, 2), ("dp", "tp", "sp"))
  q, k, v, do = _inputs(key, 2, 64, 4, 2, 16, jnp.float32)
  attention = functools.partial(
      js.context_parallel_attention, mesh=mesh, axis_name="sp", batch_axis="dp",
      head_axis="tp", is_causal=True, layout="zigzag", interpret=not ON_GPU)
  out, vjp = jax.vjp(attention, q, k, v)
  expected, vjp_ref = jax.vjp(
      lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=True)[0], q, k, v)
  for got, want in zip((out, *vjp(do)), (expected, *vjp_ref(do))):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6, rtol=3e-6)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_xla_blocks(key, strategy):
  # implementation="xla" (the default off a GPU): every block in jnp, float32.
  _check(key, 4, B=2, N=4, K=2, segments=True, logits_soft_cap=3.0, is_causal=True,
         layout="zigzag", strategy=strategy, implementation="xla")
  _check(key, 4, strategy=strategy, local_window_size=(20, 7), implementation="xla")


@pytest.mark.parametrize("implementation", ["xla", None])
def test_ring_attention_inside_a_users_shard_map(key, monkeypatch, implementation):
  # The entry point a training step uses: its own shard_map (JAX's default check_vma=True),
  # tokens kept zigzag-permuted. Off a GPU the default runs the XLA blocks; Pallas'
  # interpreter fails under check_vma (docs/numerics.md), so the kernels run there with
  # check_vma=False.
  monkeypatch.delenv("JAXSOFTMAX_INTERPRET", raising=False)
  P, B, T, N, H = 4, 1, 64, 2, 16
  q, k, v, do = _inputs(key, B, T, N, N, H, jnp.float32)
  mesh = _mesh(P)
  spec = jax.sharding.PartitionSpec(None, "sp")
  kernels_interpreted = implementation is None and not ON_GPU
  local = jax.shard_map(
      functools.partial(js.ring_attention, axis_name="sp", is_causal=True, layout="zigzag",
                        implementation=implementation,
                        interpret=True if kernels_interpreted else None),
      mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
      check_vma=not kernels_interpreted)
  sharding = jax.sharding.NamedSharding(mesh, spec)
  out = jax.jit(local)(*(jax.device_put(js.zigzag_permute(x, P), sharding)
                         for x in (q, k, v)))
  expected = reference.dot_product_attention(q, k, v, is_causal=True)[0]
  np.testing.assert_allclose(js.zigzag_unpermute(np.asarray(out), P), expected,
                             atol=2e-6, rtol=2e-6)


def test_sinks_gradient_inside_a_users_shard_map(key):
  # Replicated sinks in a user's shard_map (check_vma=True, the XLA blocks): each device
  # holds part of dsinks, and the transpose of their cast to varying sums it.
  P, B, T, N, H = 4, 1, 64, 2, 16
  q, k, v, do = _inputs(key, B, T, N, N, H, jnp.float32)
  sinks = jnp.array([-1.0, 2.0])
  mesh, spec = _mesh(P), jax.sharding.PartitionSpec(None, "sp")
  local = jax.shard_map(
      lambda q, k, v, sinks: js.ring_attention(q, k, v, axis_name="sp", is_causal=True,
                                               implementation="xla", sinks=sinks),
      mesh=mesh, in_specs=(spec, spec, spec, jax.sharding.PartitionSpec()), out_specs=spec)
  placed = [jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)) for x in (q, k, v)]
  loss = lambda attention, sinks, *qkv: jnp.sum(attention(*qkv, sinks) * do)
  got = jax.jit(jax.grad(functools.partial(loss, local)))(sinks, *placed)
  expected = jax.grad(functools.partial(loss, lambda *a: reference.dot_product_attention(
      *a[:3], is_causal=True, sinks=a[3])[0]))(sinks, q, k, v)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_causal_zigzag_ring_program():
  # What the ring's overlap on GPUs rests on (benchmarks/results/tuning/ring_attention_*): no
  # conditional (the steps' tiles are placed by the device index instead), and one
  # transfer a hop, K and V (and dK, dV) stacked into one buffer. Read from the lowered
  # program: the backward's kernels and hops run inside the transpose of the output's
  # tangent map (`linear_map.LinearMap`), which a jaxpr shows as one primitive.
  P, T, N, H = 4, 64, 2, 16
  q, k, v, do = _inputs(jax.random.PRNGKey(0), 1, T, N, N, H, jnp.float32)
  mesh, spec = _mesh(P), jax.sharding.PartitionSpec(None, "sp")
  local = jax.shard_map(
      functools.partial(js.ring_attention, axis_name="sp", is_causal=True, layout="zigzag",
                        interpret=True),
      mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
  q, k, v, do = (jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
                 for x in (q, k, v, do))
  program = jax.jit(lambda q, k, v, do: jax.vjp(local, q, k, v)[1](do)).lower(
      q, k, v, do).as_text()
  assert "stablehlo.case" not in program and "stablehlo.if" not in program
  hops = re.findall(r'"stablehlo.collective_permute".*: \((tensor<[^>]*>)\)', program)
  # forward: P - 1 hops of K, V; backward: P - 1 of K, V and P of the accumulators.
  assert len(hops) == 3 * P - 2, hops
  assert all(hop.startswith(f"tensor<2x1x{T // P}x") for hop in hops), hops


def test_zigzag_permutation():
  x = jnp.arange(16)[None]
  np.testing.assert_array_equal(
      js.zigzag_permute(x, 2),
      [[0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]])
  y = jax.random.normal(jax.random.PRNGKey(0), (2, 24, 3))
  np.testing.assert_array_equal(js.zigzag_unpermute(js.zigzag_permute(y, 3), 3), y)
  with pytest.raises(ValueError, match="multiple of 2 \\* num_shards = 8"):
    js.zigzag_permute(jnp.zeros((1, 12)), 4)


def test_bad_input():
  mesh = _mesh(2)
  q = jnp.zeros((1, 30, 2, 16), jnp.float32)
  cp = functools.partial(js.context_parallel_attention, mesh=mesh, interpret=True)
  with pytest.raises(ValueError, match="axis_name 'x' is not an axis of the mesh"):
    cp(q, q, q, axis_name="x")
  with pytest.raises(ValueError, match=r"sequence axis \(1\) of query \(1, 30, 2, 16\) must "
                                       r"be a multiple of 4 \(2 devices on 'sp', two chunks"):
    cp(q, q, q, axis_name="sp", layout="zigzag")
  with pytest.raises(ValueError, match="layout must be one of"):
    cp(q, q, q, axis_name="sp", layout="striped")
  with pytest.raises(ValueError, match="strategy must be one of"):
    cp(q, q, q, axis_name="sp", strategy="tree")
  with pytest.raises(ValueError, match="local_window_size needs layout='contiguous'"):
    cp(jnp.zeros((1, 32, 2, 16)), jnp.zeros((1, 32, 2, 16)), jnp.zeros((1, 32, 2, 16)),
       axis_name="sp", layout="zigzag", local_window_size=3)
  with pytest.raises(ValueError, match="need query and key shards of one length"):
    cp(q, q[:, :10], q[:, :10], axis_name="sp", is_causal=True)
  with pytest.raises(ValueError, match="axis_name 'sp' is not an axis of the enclosing "
                                       "shard_map"):
    js.ring_attention(q, q, q, axis_name="sp", interpret=True)
  with pytest.raises(TypeError, match="deterministic must be a bool or None"):
    cp(q, q, q, axis_name="sp", deterministic=1)
  with pytest.raises(ValueError, match=r"ring_attention: sinks must be a floating array of "
                                       r"shape \(N,\) = \(2,\)"):
    cp(q, q, q, axis_name="sp", sinks=jnp.zeros(3))
  with pytest.raises(ValueError, match=r"ring_attention: value \(1, 15, 2, 8\) must have "
                                       r"the head dim of key \(1, 15, 2, 16\)"):
    cp(q, q, q[..., :8], axis_name="sp")


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_two_gpus(key, strategy):
  # The compiled kernels (the Hopper forward where there is one) on the 2-GPU machine.
  if len(jax.devices()) < 2:
    pytest.skip("needs two GPUs")
  _check(key, 2, B=2, T=3000, N=8, K=2, H=128, strategy=strategy, layout="zigzag",
         is_causal=True)
