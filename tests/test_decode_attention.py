"""decode_attention: output and lse of the Triton decode kernel (interpreted on a CPU)
and of the Hopper (Mosaic GPU) kernel (GPU-marked: it has no interpret mode) against the
float64 truth under the 2x rule, contiguous and paged caches, every mask; the unused
tail never leaks; split counts agree; bad input names the argument; the Hopper kernel
lowers for CUDA on any machine, and says why where it cannot run a call."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoftmax as js
from jaxsoftmax._core import mosaic_gpu as mosaic_device
from jaxsoftmax._core import pallas
from jaxsoftmax._core.state import reduce_lse
from jaxsoftmax.attention.decode import api as decode_api
from jaxsoftmax.attention.decode import mosaic_gpu, reference
from tolerance import assert_2x, truth

ON_GPU = jax.default_backend() == "gpu"


def _cache(key, B, S, K, H, dtype, page_size):
  """(key, value, block_table): contiguous (B, S, K, H) without a page size, else pools
  of pages (a few more than the sequences need) behind a shuffled block table."""
  kk, kv, kp = jax.random.split(key, 3)
  if page_size is None:
    shape, table = (B, S, K, H), None
  else:
    per_seq = -(-S // page_size)
    pages = B * per_seq + 3
    shape = (pages, page_size, K, H)
    table = jax.random.permutation(kp, pages)[:B * per_seq].reshape(B, per_seq)
    table = table.astype(jnp.int32)
  k = jax.random.normal(kk, shape, jnp.float32).astype(dtype)
  v = jax.random.normal(kv, shape, jnp.float32).astype(dtype)
  return k, v, table


def _check(q, k, v, lengths, table, impl="triton", **options):
  """out and lse of the kernel ``impl`` against the truth (2x rule)."""
  run = lambda impl, q, k, v: js.decode_attention(
      q, k, v, lengths, block_table=table, return_residual=True, implementation=impl,
      interpret=not ON_GPU if impl == "triton" else None, **options)
  got = jax.jit(functools.partial(run, impl))(q, k, v)
  in_dtype = jax.jit(functools.partial(run, "xla"))(q, k, v)
  ref = lambda q, k, v: reference.decode_attention(
      q, k, v, lengths, block_table=table, scale=options.get("scale"),
      logits_soft_cap=options.get("logits_soft_cap"),
      window_left=_left(options.get("local_window_size")), sinks=options.get("sinks"))
  exact = truth(ref, q, k, v)
  for what, a, b, c in zip(("out", "lse"), got, in_dtype, exact):
    assert_2x(a, b, c, what=what)
  return got


def _left(window):
  return window if window is None or isinstance(window, int) else window[0]


# (B, T, N, K, H, S, page_size, lengths, options)
CASES = [
    pytest.param(3, 1, 8, 8, 64, 200, None, [0, 1, 200], {}, id="T1-MHA-lengths-0-1-S"),
    pytest.param(2, 3, 8, 2, 128, 150, None, [77, 3], {}, id="T3-GQA4"),
    pytest.param(2, 16, 8, 1, 64, 100, None, [100, 40], {}, id="T16-MQA"),
    pytest.param(2, 2, 16, 2, 64, 300, 16, [32, 257], {}, id="page16-GQA8-boundaries"),
    pytest.param(2, 4, 4, 2, 128, 256, 64, [64, 130], dict(logits_soft_cap=5.0),
                 id="page64-softcap"),
    pytest.param(1, 3, 4, 1, 256, 512, 256, [300], dict(local_window_size=100),
                 id="page256-H256-window"),
    pytest.param(2, 2, 4, 2, 96, 120, 48, [120, 49], dict(local_window_size=(10, 0)),
                 id="page48-H96-window"),
    # A page size that is no multiple of the 64-position block: blocks span two pages.
    pytest.param(2, 2, 4, 2, 64, 600, 200, [128, 529], dict(local_window_size=150),
                 id="page200-window"),
]


# bfloat16 on every case; float32 (the unfused exponent, `logits.Logits`) on two: its
# factor the scale (T3-GQA4, head dim 128, where float32 also changes the tiles' stage
# bytes) and 1 under a soft cap (page64-softcap). Windows and pages do not meet the
# exponent's form.
DTYPE_CASES = ([pytest.param(jnp.bfloat16, *case.values, id=f"{case.id}-bfloat16")
                for case in CASES]
               + [pytest.param(jnp.float32, *case.values, id=f"{case.id}-float32")
                  for case in (CASES[1], CASES[4])]
               + [pytest.param(jnp.float16, *CASES[4].values, id=f"{CASES[4].id}-float16")])


@pytest.mark.parametrize("dtype, B, T, N, K, H, S, page_size, lengths, options", DTYPE_CASES)
def test_matches_truth(key, B, T, N, K, H, S, page_size, lengths, options, dtype):
  kq, kc = jax.random.split(key)
  q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
  k, v, table = _cache(kc, B, S, K, H, dtype, page_size)
  out, lse = _check(q, k, v, jnp.array(lengths), table, **options)
  empty = np.array(lengths) == 0
  np.testing.assert_array_equal(out[empty], 0)
  assert np.all(np.isneginf(lse[empty]))


# Attention sinks (docs/math.md) join the splits' merge: out and lse under the 2x rule,
# an empty sequence gives out 0 and lse = its sink. Sinks below and above the logits.
SINK_CASES = [
    pytest.param("triton", jnp.float32, 3, 2, 8, 2, 64, 200, None, [0, 2, 200],
                 id="triton-T2-GQA4-empty"),
    pytest.param("triton", jnp.bfloat16, 2, 1, 4, 1, 128, 300, 16, [257, 40],
                 id="triton-T1-MQA-page16"),
    *(pytest.param("mosaic_gpu", dtype, 2, 3, 8, 2, 128, 520, page, [520, 0],
                   marks=pytest.mark.gpu, id=f"mosaic_gpu-T3-GQA4-{name}")
      for dtype, page, name in ((jnp.bfloat16, None, "contiguous"),
                                (jnp.float16, 64, "page64"))),
]


@pytest.mark.parametrize("impl, dtype, B, T, N, K, H, S, page_size, lengths", SINK_CASES)
def test_sinks(key, impl, dtype, B, T, N, K, H, S, page_size, lengths):
  kq, kc = jax.random.split(key)
  q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
  k, v, table = _cache(kc, B, S, K, H, dtype, page_size)
  sinks = jnp.linspace(-3.0, 4.0, N)
  out, lse = _check(q, k, v, jnp.array(lengths), table, impl, sinks=sinks,
                    logits_soft_cap=8.0)
  empty = np.array(lengths) == 0
  np.testing.assert_array_equal(out[empty], 0)
  np.testing.assert_allclose(lse[empty], np.broadcast_to(sinks, lse[empty].shape),
                             rtol=1e-6)


# The Triton kernel (interpreted off a GPU) in float32; the Hopper kernel in bfloat16,
# on a GPU, at page sizes below, at and above its block.
NAN_CASES = [
    pytest.param("triton", jnp.float32, None, id="triton-contiguous"),
    pytest.param("triton", jnp.float32, 16, id="triton-paged"),
    *(pytest.param("mosaic_gpu", jnp.bfloat16, page_size, marks=pytest.mark.gpu,
                   id=f"mosaic_gpu-{name}")
      for name, page_size in (("contiguous", None), ("page16", 16), ("page64", 64),
                              ("page256", 256))),
]


@pytest.mark.parametrize("impl, dtype, page_size", NAN_CASES)
def test_nan_past_the_length_does_not_leak(key, impl, dtype, page_size):
  # NaN everywhere at or past each length: the result is finite and the truth's.
  B, T, N, K, H, S = 2, 2, 4, 2, 64, 96
  if page_size == 256:  # blocks of 128 positions, the length inside the second
    S = 512
  kq, kc = jax.random.split(key)
  q = jax.random.normal(kq, (B, T, N, H)).astype(dtype)
  k, v, table = _cache(kc, B, S, K, H, dtype, page_size)
  lengths = jnp.array([37, 64] if S == 96 else [300, 129])
  contiguous = lambda a: reference.contiguous_cache(a, table)
  tail = (jnp.arange(S)[None, :] >= lengths[:, None])[:, :, None, None]
  if page_size is None:
    k, v = jnp.where(tail, jnp.nan, k), jnp.where(tail, jnp.nan, v)
  else:  # the positions of each page past its sequence's length
    pos = jnp.zeros(k.shape[:2], bool)
    for b in range(B):
      for j, page in enumerate(np.asarray(table[b])):
        pos = pos.at[page].set(j * page_size + jnp.arange(page_size) >= lengths[b])
    k = jnp.where(pos[:, :, None, None], jnp.nan, k)
    v = jnp.where(pos[:, :, None, None], jnp.nan, v)
  assert np.isnan(np.asarray(contiguous(k).astype(jnp.float32))).any()
  out, lse = _check(q, k, v, lengths, table, impl)
  assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
  assert np.isfinite(np.asarray(lse)).all()


def test_empty_cache_and_no_new_tokens():
  # A cache of no positions (every length 0) and a call with no new tokens: the XLA
  # path, output 0 and lse -inf, or an empty output.
  q, k = jnp.ones((2, 1, 4, 64)), jnp.ones((2, 0, 2, 64))
  out, lse = js.decode_attention(q, k, k, jnp.array([0, 0]), return_residual=True)
  np.testing.assert_array_equal(out, 0)
  assert np.isneginf(np.asarray(lse)).all()
  out = js.decode_attention(jnp.ones((2, 0, 4, 64)), jnp.ones((2, 8, 2, 64)),
                            jnp.ones((2, 8, 2, 64)), jnp.array([3, 8]))
  assert out.shape == (2, 0, 4, 64)


def test_nan_in_the_cache_is_not_hidden(key):
  B, T, N, K, H, S = 1, 1, 2, 1, 64, 40
  q = jax.random.normal(key, (B, T, N, H))
  k, v, _ = _cache(key, B, S, K, H, jnp.float32, None)
  out = js.decode_attention(q, k.at[0, 5, 0, 0].set(jnp.nan), v, jnp.array([40]),
                            implementation="triton", interpret=not ON_GPU)
  assert np.isnan(np.asarray(out)).all()


def test_split_counts_agree(key):
  # One split to one per block: the same result within float32 rounding.
  B, T, N, K, H, S = 1, 2, 4, 2, 64, 700
  kq, kc = jax.random.split(key)
  q = jax.random.normal(kq, (B, T, N, H))
  k, v, _ = _cache(kc, B, S, K, H, jnp.float32, None)
  run = lambda n: js.decode_attention(q, k, v, jnp.array([650]), num_splits=n,
                                      interpret=not ON_GPU, return_residual=True)
  base = run(1)
  for n in (2, 5, 11, 64):
    for a, b in zip(run(n), base):
      np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("splits, sinks", [(1, False), (5, True), (70, True)],
                         ids=["one-split", "five-sinks", "two-chunks-sinks"])
def test_merge_kernel_matches_the_float32_merge(key, splits, sinks):
  # The merge kernel against the same merge in jnp, on partial results
  # with an empty split, an empty row, head dim 96 (padded to 128) and more splits than
  # one chunk; a NaN in one split's statistics is the row's NaN.
  from jaxsoftmax.attention.decode import triton
  from jaxsoftmax.attention.logits import lse as natural_lse
  B, T, N, K, H = 2, 3, 8, 2, 96
  dims = triton.DecodeDims(B, T, N, K, H, 8192, None, 0, splits)
  R = dims.rows
  ko, km, kl, ks = jax.random.split(key, 4)
  o = jax.random.normal(ko, (splits, B, K, R, H))
  m = (3 * jax.random.normal(km, (splits, B, K, R))).at[0, 0, 0, 0].set(-jnp.inf)
  m = m.at[:, 1, 1, 2].set(-jnp.inf).at[-1, 1, 0, 5].set(jnp.nan)
  log2_l = 4 * jax.random.uniform(kl, (splits, B, K, R))
  sink = jax.random.normal(ks, (B, N)) if sinks else None
  got = triton.merge(o, m, log2_l, dims=dims, scale=0.3, softcap=None, sinks=sink,
                     out_dtype=jnp.float32, interpret=not ON_GPU)
  # The same merge in jnp, rows (t, g) of each KV head moved to (t, k·G + g).
  lse_s = natural_lse(m, log2_l, scale=0.3, softcap=None)
  parts = lse_s if sink is None else jnp.concatenate(
      [lse_s, jnp.tile(sink.reshape(1, B, K, 1, N // K), (1, 1, 1, T, 1)).reshape(
          1, B, K, R)])
  lse = reduce_lse(parts, axis=0)
  w = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse_s - lse[None]))
  out = jnp.sum(w[..., None] * o, axis=0)
  to_heads = lambda x: jnp.moveaxis(x.reshape(B, K, T, N // K, *x.shape[3:]), 2, 1)
  for a, b in zip(got, (to_heads(out).reshape(B, T, N, H), to_heads(lse).reshape(B, T, N))):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)
  assert np.isnan(np.asarray(got[0][1, 1, 1])).all()  # row (t=1, g=1) of head 1: NaN


def test_default_split_count():
  # One wave of programs, each split holding at least four blocks of the cache: one
  # program of four stages a SM on a contiguous cache whose (sequence, KV head) pairs fit
  # on the SMs, else three programs of two stages (`DecodeBlocks.choose`).
  from jaxsoftmax.attention.decode.triton import DecodeBlocks, DecodeDims
  sds = jax.ShapeDtypeStruct

  def dims(B, S, K, H=128, dtype=jnp.bfloat16, page_size=None):
    q = sds((B, 1, 4 * K, H), dtype)
    if page_size is None:
      return DecodeDims.of(q, sds((B, S, K, H), dtype), None, None, cores=132)
    pool, table = sds((B * S // page_size, page_size, K, H), dtype), sds(
        (B, S // page_size), jnp.int32)
    return DecodeDims.of(q, pool, table, None, cores=132)

  streaming, shared = DecodeBlocks(num_stages=4, programs_per_core=1), DecodeBlocks()
  assert (dims(1, 131072, 8).splits, dims(1, 131072, 8).tiles) == (16, streaming)
  assert (dims(8, 8192, 8).splits, dims(8, 8192, 8).tiles) == (2, streaming)
  assert (dims(16, 32768, 8).splits, dims(16, 32768, 8).tiles) == (1, streaming)
  assert (dims(64, 4096, 8).splits, dims(64, 4096, 8).tiles) == (1, shared)  # 512 pairs
  assert dims(1, 100, 8).splits == 1  # two blocks: fewer than four a split
  # Paged, or four stages past 128 KiB (head dim 256, float32): three programs a SM.
  assert (dims(1, 131072, 8, page_size=64).splits,
          dims(1, 131072, 8, page_size=64).tiles) == (49, shared)
  assert dims(8, 8192, 8, H=256).tiles == shared
  assert dims(8, 8192, 8, dtype=jnp.float32).tiles == shared


def test_backward_raises():
  q, k = jnp.ones((1, 1, 2, 64)), jnp.ones((1, 8, 1, 64))
  loss = lambda q: jnp.sum(js.decode_attention(q, k, k, jnp.array([8]),
                                               implementation="triton",
                                               interpret=not ON_GPU))
  with pytest.raises(NotImplementedError, match="decode_attention has no backward"):
    jax.grad(loss)(q)


def test_bad_input():
  q, k, lengths = jnp.ones((2, 3, 4, 64)), jnp.ones((2, 16, 2, 64)), jnp.array([5, 16])
  da = js.decode_attention
  with pytest.raises(ValueError, match="lengths must be an integer array of shape"):
    da(q, k, k, jnp.array([5.0, 6.0]))
  with pytest.raises(ValueError, match="lengths must lie in \\[0, 16\\]"):
    da(q, k, k, jnp.array([5, 17]))
  with pytest.raises(ValueError, match="a nonzero length must hold the 3 new tokens"):
    da(q, k, k, jnp.array([2, 16]))
  with pytest.raises(ValueError, match="multiple of the KV heads"):
    da(q, jnp.ones((2, 16, 3, 64)), jnp.ones((2, 16, 3, 64)), lengths)
  with pytest.raises(ValueError, match="head dim 32 differs"):
    da(q, jnp.ones((2, 16, 2, 32)), jnp.ones((2, 16, 2, 32)), lengths)
  # One head dim for keys and values (dot_product_attention takes two).
  with pytest.raises(ValueError, match=r"key and value must share one 4-d shape .* got "
                                       r"\(2, 16, 2, 64\) and \(2, 16, 2, 32\)"):
    da(q, k, jnp.ones((2, 16, 2, 32)), lengths)
  with pytest.raises(ValueError, match="block_table must be int32 of shape \\(2, max_pages\\)"):
    da(q, k, k, lengths, block_table=jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match="lengths must lie in \\[0, 32\\]"):
    da(q, k, k, jnp.array([5, 33]), block_table=jnp.zeros((2, 2), jnp.int32))
  with pytest.raises(ValueError, match="implementation must be one of"):
    da(q, k, k, lengths, implementation="cuda")
  with pytest.raises(ValueError, match="local_window_size must be"):
    da(q, k, k, lengths, local_window_size=-1)
  with pytest.raises(ValueError, match="num_splits must be a positive int"):
    da(q, k, k, lengths, num_splits=0)
  with pytest.raises(ValueError, match=r"sinks must be a floating array of shape \(N,\) = "
                     r"\(4,\)"):
    da(q, k, k, lengths, sinks=jnp.zeros(2))


# Page sizes: None (contiguous), a multiple of the 64-position block (one page per
# block), and 16 (each row's page gathered).
@pytest.mark.parametrize("page_size", [None, 64, 16], ids=["contiguous", "page64", "page16"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
def test_lowers_for_cuda(as_if_on_an_h200, page_size, dtype):
  # The kernel lowers for CUDA without a GPU: Pallas API drift shows on every CI run.
  sds = jax.ShapeDtypeStruct
  B, T, N, K, H = 4, 4, 32, 8, 128
  paged = page_size is not None
  k = sds((300, page_size, K, H), dtype) if paged else sds((B, 1000, K, H), dtype)
  table = sds((B, 1280 // page_size), jnp.int32) if paged else None
  run = lambda q, k, v, lengths, table: js.decode_attention(
      q, k, v, lengths, block_table=table, implementation="triton", interpret=False,
      logits_soft_cap=30.0, local_window_size=100)
  text = jax.jit(run).trace(sds((B, T, N, H), dtype), k, k, sds((B,), jnp.int32),
                            table).lower(lowering_platforms=("cuda",)).as_text()
  assert re.search(r'name = \\?"decode_attention', text)
  assert re.search(r'name = \\?"decode_attention_merge', text)  # 4-5 splits merge


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("B, T, N, K, H, S, page_size", [
    (8, 1, 32, 8, 128, 8192, None), (4, 4, 32, 8, 128, 4100, 64),
    (1, 16, 64, 8, 128, 32768, 256), (3, 3, 8, 1, 256, 1000, 16),
], ids=["B8-S8192", "T4-page64", "T16-page256", "MQA-H256-page16"])
def test_matches_truth_gpu(key, B, T, N, K, H, S, page_size, dtype):
  kq, kc, kl = jax.random.split(key, 3)
  q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
  k, v, table = _cache(kc, B, S, K, H, dtype, page_size)
  lengths = jax.random.randint(kl, (B,), T, S + 1).at[0].set(S)
  _check(q, k, v, lengths, table)


def test_generate_example_on_a_cpu():
  # examples/generate.py on the interpreted kernels: contiguous and paged decoding pick
  # jax.nn's tokens, with its logits. On a CPU wherever the suite runs: on a GPU the
  # example takes its GPU size, whose bfloat16 logits part at near ties.
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAXSOFTMAX_INTERPRET="1", JAX_PLATFORMS="cpu", PYTHONPATH=root)
  out = subprocess.run([sys.executable, os.path.join(root, "examples", "generate.py"),
                        "--new-tokens", "6"], env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0 and "OK:" in out.stdout, out.stdout + out.stderr
  assert out.stdout.count("100.0% of the picks") == 2


def test_update_kv_cache():
  # T = 2 new tokens at positions lengths - 2 and lengths - 1; a length of 0 writes
  # nothing; in a pool each lands in its sequence's page, at its slot.
  new = jnp.arange(1.0, 5.0).reshape(2, 2, 1, 1)
  cache = js.update_kv_cache(jnp.zeros((2, 6, 1, 1)), new, jnp.array([3, 0]))
  np.testing.assert_array_equal(cache[..., 0, 0], [[0, 1, 2, 0, 0, 0], [0] * 6])
  table = jnp.array([[3, 1], [0, 2]], jnp.int32)
  pool = js.update_kv_cache(jnp.zeros((5, 4, 1, 1)), new, jnp.array([5, 2]),
                            block_table=table)
  want = np.zeros((5, 4))
  want[3, 3], want[1, 0], want[0, 0], want[0, 1] = 1, 2, 3, 4
  np.testing.assert_array_equal(pool[..., 0, 0], want)
  # What it writes is what decode_attention reads: the same result as the contiguous cache.
  k = jnp.arange(2 * 8 * 1 * 64, dtype=jnp.float32).reshape(2, 8, 1, 64) / 1000
  lengths = jnp.array([8, 5])
  paged = jnp.zeros((5, 4, 1, 64))
  for t in range(8):
    paged = js.update_kv_cache(paged, k[:, t:t + 1], jnp.where(t < lengths, t + 1, 0),
                               block_table=table)
  q = jnp.ones((2, 1, 2, 64))
  np.testing.assert_allclose(
      js.decode_attention(q, paged, paged, lengths, block_table=table),
      js.decode_attention(q, k, k, lengths), rtol=1e-6)


# --- the Hopper (Mosaic GPU) kernel ----------------------------------------------------

# (B, T, N, K, H, S, page_size, lengths, options): every case it runs. Blocks of 64
# positions (128 at head dim 64): page 16 gathers 4 or 8 pages a block, 32 two, 64 one,
# 128 and 256 hold several blocks.
HOPPER_CASES = [
    CASES[0],  # T = 1, MHA, head dim 64, lengths 0, 1 and S
    pytest.param(2, 3, 8, 2, 128, 152, None, [77, 3], {}, id="T3-GQA4"),
    pytest.param(2, 16, 8, 2, 64, 136, None, [136, 40], {}, id="T16-GQA4-64-rows"),
    pytest.param(2, 8, 64, 8, 128, 520, None, [520, 200], {}, id="T8-GQA8-64-rows"),
    CASES[3],  # page 16, GQA 8, lengths at page boundaries
    CASES[4],  # page 64, soft cap
    CASES[5],  # page 256, head dim 256, window
    pytest.param(2, 2, 8, 2, 192, 256, 32, [64, 200], dict(local_window_size=(70, 0)),
                 id="page32-H192-window"),
    pytest.param(2, 5, 8, 1, 128, 384, 128, [384, 129], dict(logits_soft_cap=20.0),
                 id="MQA-page128-softcap"),
    pytest.param(3, 1, 32, 8, 128, 2048, None, [2048, 1000, 64],
                 dict(local_window_size=300), id="T1-GQA4-window"),
]
HOPPER_DTYPE_CASES = (
    [pytest.param(jnp.bfloat16, *case.values, id=f"{case.id}-bfloat16")
     for case in HOPPER_CASES]
    + [pytest.param(jnp.float16, *case.values, id=f"{case.id}-float16")
       for case in HOPPER_CASES[2::3]])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, B, T, N, K, H, S, page_size, lengths, options",
                         HOPPER_DTYPE_CASES)
def test_hopper_matches_truth_gpu(key, B, T, N, K, H, S, page_size, lengths, options,
                                  dtype):
  kq, kc = jax.random.split(key)
  q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
  k, v, table = _cache(kc, B, S, K, H, dtype, page_size)
  assert mosaic_gpu.unsupported(q, k, table) is None
  out, lse = _check(q, k, v, jnp.array(lengths), table, "mosaic_gpu", **options)
  empty = np.array(lengths) == 0
  np.testing.assert_array_equal(out[empty], 0)
  assert np.all(np.isneginf(lse[empty]))


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "grid"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("B, T, N, K, H, S, page_size", [
    (8, 1, 32, 8, 128, 8192, None), (4, 4, 32, 8, 128, 4100, 64),
    (1, 8, 64, 8, 128, 32768, 256), (3, 3, 8, 1, 256, 1000, 16),
], ids=["B8-S8192", "T4-page64", "T8-page256", "MQA-H256-page16"])
def test_hopper_large_gpu(key, B, T, N, K, H, S, page_size, dtype, persistent):
  # Random lengths (the first full) over many blocks and splits, both CTA schedules.
  kq, kc, kl = jax.random.split(key, 3)
  q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
  k, v, table = _cache(kc, B, S, K, H, dtype, page_size)
  lengths = jax.random.randint(kl, (B,), T, S + 1).at[0].set(S)
  blocks = dataclasses.replace(mosaic_gpu.HopperDecodeBlocks.default(H),
                               persistent=persistent)
  plan = mosaic_gpu.plan(q, k, table, None, cores=pallas.num_cores(),
                         blocks=blocks)

  got = jax.jit(lambda q, k, v: decode_api.run_kernels(q, k, v, lengths, table, plan,
                                                       scale=H ** -0.5))(q, k, v)
  in_dtype = reference.decode_attention(q, k, v, lengths, block_table=table)
  exact = truth(lambda q, k, v: reference.decode_attention(q, k, v, lengths,
                                                           block_table=table), q, k, v)
  assert_2x(got[0].astype(dtype), in_dtype[0], exact[0], what="out")
  assert_2x(got[1], in_dtype[1], exact[1], what="lse")


@pytest.mark.gpu
def test_hopper_split_counts_agree_gpu(key):
  # One split to one per block: the same result within rounding (the output's bfloat16,
  # the lse's float32).
  B, T, N, K, H, S = 1, 2, 8, 2, 128, 704
  kq, kc = jax.random.split(key)
  q = jax.random.normal(kq, (B, T, N, H)).astype(jnp.bfloat16)
  k, v, _ = _cache(kc, B, S, K, H, jnp.bfloat16, None)
  run = lambda n: js.decode_attention(q, k, v, jnp.array([650]), num_splits=n,
                                      implementation="mosaic_gpu", return_residual=True)
  base_out, base_lse = run(1)
  for n in (2, 5, 11, 64):
    out, lse = run(n)
    np.testing.assert_allclose(out.astype(jnp.float32), base_out.astype(jnp.float32),
                               rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(lse, base_lse, rtol=2e-6, atol=2e-6)


@pytest.mark.gpu
def test_hopper_nan_in_the_cache_is_not_hidden(key):
  B, T, N, K, H, S = 1, 1, 2, 1, 64, 200
  q = jax.random.normal(key, (B, T, N, H)).astype(jnp.bfloat16)
  k, v, _ = _cache(key, B, S, K, H, jnp.bfloat16, None)
  out = js.decode_attention(q, k.at[0, 5, 0, 0].set(jnp.nan), v, jnp.array([200]),
                            implementation="mosaic_gpu")
  assert np.isnan(np.asarray(out.astype(jnp.float32))).all()


def _kernel_names(q, k, table, **options):
  text = jax.jit(lambda q, k, n, t: js.decode_attention(
      q, k, k, n, block_table=t, **options)).trace(
          q, k, jnp.full((q.shape[0],), 8, jnp.int32), table).lower().as_text()
  return "decode_attention_mosaic_gpu" in text, re.search(r'name = \\?"decode_attention"',
                                                         text) is not None


@pytest.mark.gpu
def test_default_dispatch_gpu():
  # On a Hopper GPU the default takes the Mosaic GPU kernel where it runs the call (once
  # HOPPER_BY_DEFAULT is on), the Triton kernel elsewhere (float32; a page size it does
  # not take); elsewhere Triton.
  q, k = jnp.ones((2, 1, 8, 128), jnp.bfloat16), jnp.ones((2, 256, 2, 128), jnp.bfloat16)
  hopper = mosaic_device.hopper_device() and decode_api.HOPPER_BY_DEFAULT
  assert _kernel_names(q, k, None) == (hopper, not hopper)
  f32 = lambda x: x.astype(jnp.float32)
  assert _kernel_names(f32(q), f32(k), None) == (False, True)
  pool, table = jnp.ones((8, 48, 2, 128), jnp.bfloat16), jnp.zeros((2, 4), jnp.int32)
  assert _kernel_names(q, pool, table) == (False, True)
  if mosaic_device.hopper_device():
    with pytest.raises(ValueError, match="page sizes that divide"):
      js.decode_attention(q, pool, pool, jnp.array([8, 8]), block_table=table,
                          implementation="mosaic_gpu")


def test_hopper_asked_without_a_hopper_gpu_raises():
  if mosaic_device.hopper_device():
    pytest.skip("a Hopper GPU runs it")
  q, k = jnp.ones((1, 1, 4, 64), jnp.bfloat16), jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="implementation='mosaic_gpu' cannot run this call: "
                                       "it needs a Hopper GPU"):
    js.decode_attention(q, k, k, jnp.array([100]), implementation="mosaic_gpu")


def test_hopper_unsupported_reasons(monkeypatch):
  # As if on a Hopper GPU: what the kernel leaves to the Triton kernel, and why.
  monkeypatch.setattr(mosaic_device, "hopper_device", lambda: True)
  sds = jax.ShapeDtypeStruct
  bf16 = functools.partial(sds, dtype=jnp.bfloat16)
  table = sds((2, 8), jnp.int32)
  why = lambda q, k, table=None, **kw: mosaic_gpu.unsupported(q, k, table, **kw)
  q, k = bf16((2, 4, 32, 128)), bf16((2, 1024, 8, 128))
  assert why(q, k) is None
  assert why(q, bf16((100, 16, 8, 128)), table) is None
  assert why(q, bf16((100, 256, 8, 128)), table) is None
  assert "no interpret mode" in why(q, k, interpret=True)
  f32 = sds(q.shape, jnp.float32), sds(k.shape, jnp.float32)
  assert "bfloat16 or float16" in why(*f32)
  assert "head dims of multiples of 64" in why(bf16((2, 4, 32, 96)), bf16((2, 1024, 8, 96)))
  assert "must fit one 64-row tile" in why(bf16((2, 16, 64, 128)), bf16((2, 1024, 8, 128)))
  assert "page sizes that divide" in why(q, bf16((100, 48, 8, 128)), table)
  assert "page sizes that divide" in why(q, bf16((100, 8, 8, 128)), table)
  assert "multiple of 8 positions" in why(q, bf16((2, 1020, 8, 128)))
  assert "multiple of 8 positions, 64 at least" in why(q, bf16((2, 56, 8, 128)))


def test_hopper_dispatch(monkeypatch):
  # As if on a Hopper GPU: the default takes the Hopper kernel where it runs the call
  # once HOPPER_BY_DEFAULT is on, the Triton kernel elsewhere; asked for, it says why not.
  monkeypatch.setattr(mosaic_device, "hopper_device", lambda: True)
  sds = jax.ShapeDtypeStruct
  q, k = sds((2, 1, 8, 128), jnp.bfloat16), sds((2, 256, 2, 128), jnp.bfloat16)
  f32 = sds(q.shape, jnp.float32), sds(k.shape, jnp.float32)
  backend = lambda impl, q, k: decode_api._backend(impl, q, k, None, interpret=False)
  assert backend(None, q, k) == ("mosaic_gpu" if decode_api.HOPPER_BY_DEFAULT else "triton")
  assert backend("mosaic_gpu", q, k) == "mosaic_gpu"
  assert backend("triton", q, k) == "triton"
  monkeypatch.setattr(decode_api, "HOPPER_BY_DEFAULT", True)
  assert backend(None, q, k) == "mosaic_gpu"
  assert backend(None, *f32) == "triton"
  with pytest.raises(ValueError, match="cannot run this call: it takes bfloat16 or float16"):
    backend("mosaic_gpu", *f32)


def test_hopper_split_count():
  # Rounds of one item per SM: every SM busy where the batch allows, no round half full.
  sds = jax.ShapeDtypeStruct
  plan = lambda B, S, K: mosaic_gpu.plan(sds((B, 1, 4 * K, 128), jnp.bfloat16),
                                         sds((B, S, K, 128), jnp.bfloat16), None, None,
                                         cores=132)
  assert plan(8, 8192, 8).dims.splits == 2  # 128 items of 64 blocks
  assert plan(1, 131072, 8).dims.splits == 33  # 264 items: two per SM
  assert plan(64, 4096, 8).dims.splits == 1
  assert plan(16, 32768, 8).dims.splits == 1
  assert plan(1, 200, 8).dims.splits == 1  # four blocks: one split
  assert mosaic_gpu.plan(sds((1, 1, 8, 128), jnp.bfloat16), sds((1, 704, 2, 128),
                                                                jnp.bfloat16),
                         None, 64, cores=132).dims.splits == 11  # one per block at most


# (H, T, G, page_size, options, persistent): the kernel lowers for CUDA off a GPU.
HOPPER_LOWERINGS = [
    pytest.param(128, 1, 4, None, {}, True, id="contiguous"),
    pytest.param(128, 4, 4, 64, dict(softcap=30.0, window_left=100), True,
                 id="page64-softcap-window"),
    pytest.param(128, 4, 4, 16, dict(window_left=100), False, id="page16-window-grid"),
    pytest.param(256, 3, 8, 256, {}, True, id="page256-H256"),
    pytest.param(256, 3, 8, 16, {}, True, id="page16-H256"),
    pytest.param(64, 16, 4, None, {}, True, id="H64-64-rows"),
    pytest.param(192, 1, 1, 32, dict(softcap=5.0), False, id="page32-H192-grid"),
]


@pytest.mark.parametrize("H, T, G, page_size, options, persistent", HOPPER_LOWERINGS)
def test_hopper_lowers_for_cuda(H, T, G, page_size, options, persistent):
  # The Hopper kernel cannot run off a GPU, but it lowers for CUDA anywhere: Mosaic GPU
  # API drift shows on every CI run.
  sds = jax.ShapeDtypeStruct
  B, K, S = 2, 2, 1024
  if page_size is None:
    k, table = sds((B, S, K, H), jnp.bfloat16), None
  else:
    k = sds((B * S // page_size + 3, page_size, K, H), jnp.bfloat16)
    table = sds((B, S // page_size), jnp.int32)
  q = sds((B, T, G * K, H), jnp.bfloat16)
  blocks = dataclasses.replace(mosaic_gpu.HopperDecodeBlocks.default(H),
                               persistent=persistent)
  plan = mosaic_gpu.plan(q, k, table, None, cores=132, blocks=blocks)
  run = lambda q, k, v, n, t: mosaic_gpu.forward(
      q, k, v, n, t, plan=plan, scale=0.1, softcap=options.get("softcap"),
      window_left=options.get("window_left"))
  text = jax.jit(run).trace(q, k, k, sds((B,), jnp.int32), table).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "decode_attention_mosaic_gpu" in text
