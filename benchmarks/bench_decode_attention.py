"""decode_attention on the GPU: our Triton kernel over contiguous and paged KV caches
beside XLA, cuDNN, FlashAttention-3 and Pallas' own decode kernels, in one run on the
same inputs, with the read ceiling measured beside them.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_decode_attention.py --out benchmarks/results

Shapes (B sequences, cache length S, N query heads over K KV heads, head dim H, bfloat16):
8x8192x32x8x128, 64x4096x32x8x128, 1x131072x32x8x128 and 16x32768x64x8x128, each with
T = 1 new token per sequence, and the first also with T = 4 (the new tokens causal among
themselves); every sequence full (lengths = S). Each shape runs on a contiguous cache
(B, S, K, H) and on paged pools (pages, page_size, K, H) at page sizes 16, 64 and 256,
the pages of the same cache behind a block table that is a shuffled permutation of the
pool (mode "paged P"). ``--only`` takes indices into that list: 0 and 1 are the first
shape at T = 1 and T = 4, 2 to 4 the others.

Decoding is memory-bound: GB/s are over the bytes of K and V a call must read, 2·B·S·K·H·
itemsize (the query and the output are a few KiB), and % is of the read ceiling: a Pallas
read kernel over the same K and V in the same run (`harness.read_kernel`). Errors: max
abs and normwise relative error of the output against the float64 truth (the reference
on float64 copies of the same inputs, `harness.float64_truth`); the paged pools hold the
same cache, so every row of a shape shares one truth.

Implementations:
  - `jaxsoftmax mosaic_gpu`: ``decode_attention(..., implementation="mosaic_gpu")``, the
    Hopper kernel (contiguous and paged; on a Hopper GPU only, no row elsewhere); the
    note gives its split count, block, stages and schedule.
  - `jaxsoftmax triton`: ``decode_attention(..., implementation="triton")`` (contiguous
    and paged); the note gives the split count it chose.
  - `xla`: ``implementation="xla"``, the reference (a paged cache gathered into one array
    first, as that path does).
  - `cudnn`: ``jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
    implementation="cudnn")``, contiguous T = 1 only (its causal mask aligns the queries
    with the cache's start, not its end); a refusal is a row that says why.
  - `fa3`: ``flash_attn3_jax.flash_mha_with_kvcache`` (FlashAttention-3's kv-cache entry
    point, from the peer wheel in .peers, see run_gpu.sh), contiguous and paged
    (``page_table=``), causal for T > 1 (FA3 aligns the queries with the cache's end).
    That binding takes num_splits from its caller (its default is 1), and the best count
    depends on the shape: it runs at 1, 4 and 16 splits, a row each (`FA3_SPLITS`); the
    summary takes the fastest.
  - `pallas decode gqa`: ``jax.experimental.pallas.ops.gpu.decode_attention.gqa``,
    contiguous T = 1 (it takes one query per sequence; timed as called, with whatever
    the swap of the cache to heads-first that it does inside costs).
  - `pallas paged_attention`: ``jax.experimental.pallas.ops.gpu.paged_attention``, paged
    T = 1, on pools laid out its way (K, pages, page_size, H) once, outside the timing;
    it takes no softmax scale, so the row scales q (timed with that multiply).

A peer that is absent or needs a GPU (a --smoke run on a CPU) gets a row saying so, and
one that fails on a shape a row with its error, never a crash. The table ends with each
shape's ratio of each of ours to the fastest peer whose errors are right
(`vs_best_peer`).

For quick runs the environment narrows a run: DECODE_IMPLS (comma-separated row names)
measures only those rows, DECODE_PAGE_SIZES (comma-separated) replaces each shape's page
sizes, and DECODE_HOPPER_VARIANTS (comma-separated BLOCKxSTAGES, then "g" for one CTA
per item instead of persistent CTAs, e.g. "64x5,128x2,64x4g") adds a row of the Hopper
kernel with those tiles each, named "jaxsoftmax mosaic_gpu 64x5"; DECODE_TRITON_VARIANTS
(comma-separated BLOCKxSTAGES, then "p" and the programs per SM that the split count
aims at, e.g. "64x3p2,128x2p4": `triton.DecodeBlocks`) a row of the Triton kernel with
those tiles each, named "jaxsoftmax triton 64x3p2".
"""

from __future__ import annotations

import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import harness
import jaxsoftmax as js
from jaxsoftmax._core import mosaic_gpu as mosaic_device
from jaxsoftmax._core import pallas
from jaxsoftmax._core.pallas import pl
from jaxsoftmax.attention.decode import mosaic_gpu, reference, triton
from jaxsoftmax.attention.decode.api import run_kernels

PAGE_SIZES = (16, 64, 256)
# (B, S, N, K, H, T, page sizes); shape indices for --only.
SHAPES = [((8, 8192, 32, 8, 128, 1, PAGE_SIZES), jnp.bfloat16),
          ((8, 8192, 32, 8, 128, 4, PAGE_SIZES), jnp.bfloat16),
          ((64, 4096, 32, 8, 128, 1, PAGE_SIZES), jnp.bfloat16),
          ((1, 131072, 32, 8, 128, 1, PAGE_SIZES), jnp.bfloat16),
          ((16, 32768, 64, 8, 128, 1, PAGE_SIZES), jnp.bfloat16)]
# S not a multiple of the page: the pools' last page of each sequence is part padding.
SMOKE_SHAPES = [((2, 100, 4, 2, 64, 1, (16,)), jnp.bfloat16),
                ((2, 100, 4, 2, 64, 2, (16,)), jnp.bfloat16)]
OURS = "jaxsoftmax triton"
HOPPER = "jaxsoftmax mosaic_gpu"
# Implementations per layout, in row order (bench_shape adds one row for each).
FA3_SPLITS = (1, 4, 16)
_FA3 = tuple(f"fa3 splits {n}" for n in FA3_SPLITS)
CONTIGUOUS = (OURS, "xla", "cudnn", *_FA3, "pallas decode gqa")
PAGED = (OURS, "xla", *_FA3, "pallas paged_attention")


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _env_list(name: str):
  value = os.environ.get(name, "").strip()
  return [x.strip() for x in value.split(",") if x.strip()] if value else None


def _hopper_variants():
  """(row name, HopperDecodeBlocks) of DECODE_HOPPER_VARIANTS."""
  variants = []
  for spec in _env_list("DECODE_HOPPER_VARIANTS") or []:
    block_k, stages, grid = re.fullmatch(r"(\d+)x(\d+)(g?)", spec).groups()
    blocks = mosaic_gpu.HopperDecodeBlocks(int(block_k), int(stages), persistent=not grid)
    variants.append((f"{HOPPER} {spec}", blocks))
  return variants


def parse_triton_tiles(spec: str) -> triton.DecodeBlocks:
  """The `triton.DecodeBlocks` of a BLOCKxSTAGESpPROGRAMS spec, e.g. "64x4p1"."""
  block_k, stages, programs = re.fullmatch(r"(\d+)x(\d+)p(\d+)", spec).groups()
  return triton.DecodeBlocks(int(block_k), int(stages), int(programs))


def _triton_variants():
  """(row name, DecodeBlocks) of DECODE_TRITON_VARIANTS."""
  return [(f"{OURS} {spec}", parse_triton_tiles(spec))
          for spec in _env_list("DECODE_TRITON_VARIANTS") or []]


def _triton_fn(tiles):
  """The Triton kernel with the tiles ``tiles`` (`triton.DecodeBlocks`), on a contiguous
  cache or (with a block table ``t``) a paged one."""
  def run(q, k, v, n, t=None):
    dims = triton.DecodeDims.of(q, k, t, None, cores=pallas.num_cores(), tiles=tiles)
    out, _ = run_kernels(q, k, v, n, t, dims, scale=q.shape[-1] ** -0.5,
                         interpret=not _on_gpu(), out_dtype=q.dtype)
    return out

  return run


def _hopper_rows():
  """Our Hopper rows (the default tiles, then DECODE_HOPPER_VARIANTS): on a Hopper GPU
  only."""
  if not mosaic_device.hopper_device():
    return []
  return [(HOPPER, None)] + _hopper_variants()


def _hopper_fn(blocks, paged: bool):
  """The Hopper kernel with the tiles ``blocks`` (None: as decode_attention runs it)."""
  if blocks is None:
    if paged:
      return lambda q, k, v, n, t: js.decode_attention(q, k, v, n, block_table=t,
                                                       implementation="mosaic_gpu")
    return lambda q, k, v, n: js.decode_attention(q, k, v, n, implementation="mosaic_gpu")

  def run(q, k, v, n, t=None):
    plan = mosaic_gpu.plan(q, k, t, None, cores=pallas.num_cores(), blocks=blocks)
    out, _ = run_kernels(q, k, v, n, t, plan, scale=q.shape[-1] ** -0.5, out_dtype=q.dtype)
    return out

  return run


def _pallas_ops():
  with warnings.catch_warnings():  # importing them warns that they are deprecated
    warnings.simplefilter("ignore")
    from jax.experimental.pallas.ops.gpu import decode_attention, paged_attention
  return decode_attention, paged_attention


def _fa3_kvcache():
  """FA3's kv-cache call, or raises ImportError saying why not."""
  try:
    import flash_attn3_jax
  except Exception as e:  # noqa: BLE001 - a wheel built for another JAX may fail to load
    raise ImportError(harness.failure_note(e)) from e
  fn = getattr(flash_attn3_jax, "flash_mha_with_kvcache", None)
  if fn is None:
    raise ImportError(f"flash_attn3_jax {getattr(flash_attn3_jax, '__version__', '?')} "
                      "has no flash_mha_with_kvcache")
  return fn


def _k_splits(n: int, at_least: int) -> int:
  """Pallas' decode kernels' default 16 splits where n (positions or pages) allows it
  (the smoke shapes do not): else one."""
  return 16 if n % 16 == 0 and n // 16 >= at_least else 1


def case_inputs(case, dtype):
  """(q, k, v, lengths) of a case: the contiguous cache, every sequence full."""
  B, S, N, K, H, T, _ = case
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (B, T, N, H), dtype)
  k = jax.random.normal(keys[1], (B, S, K, H), dtype)
  v = jax.random.normal(keys[2], (B, S, K, H), dtype)
  return q, k, v, jnp.full((B,), S, jnp.int32)


def paged_cache(cache, page_size: int, seed: int):
  """(pool, block_table) of a contiguous cache (B, S, K, H): its pages (the last of each
  sequence padded with zeros) in a pool of exactly B·ceil(S/page_size) pages, shuffled,
  with page j of sequence b at ``pool[block_table[b, j]]``."""
  B, S, K, H = cache.shape
  per_seq = pl.cdiv(S, page_size)
  pages = jnp.pad(cache, ((0, 0), (0, per_seq * page_size - S), (0, 0), (0, 0)))
  pages = pages.reshape(B * per_seq, page_size, K, H)
  perm = np.random.default_rng(seed).permutation(B * per_seq)
  pool = pages[jnp.asarray(np.argsort(perm))]  # pool[perm[i]] = pages[i]
  return pool, jnp.asarray(perm.reshape(B, per_seq), jnp.int32)


def contiguous_impls(case):
  """name -> (fn(q, k, v, lengths), None) or (None, why it is not measured)."""
  B, S, N, K, H, T, _ = case
  scale = H ** -0.5
  gpu = _on_gpu()
  impls = {name: (_hopper_fn(blocks, paged=False), None)
           for name, blocks in _hopper_rows()}
  impls |= {name: (_triton_fn(tiles), None) for name, tiles in _triton_variants()}
  impls |= {
      OURS: (lambda q, k, v, n: js.decode_attention(q, k, v, n, implementation="triton"),
             None),
      "xla": (lambda q, k, v, n: js.decode_attention(q, k, v, n, implementation="xla"),
              None),
  }
  if T != 1:
    impls["cudnn"] = (None, "T = 1 only: its causal mask aligns the queries with the "
                            "cache's start")
  elif not gpu:
    impls["cudnn"] = (None, "needs a GPU")
  else:
    impls["cudnn"] = (lambda q, k, v, n: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=n, implementation="cudnn"), None)
  try:
    fa3 = _fa3_kvcache()
    for name, splits in zip(_FA3, FA3_SPLITS):
      impls[name] = ((lambda q, k, v, n, splits=splits: fa3(
          q, k, v, cache_seqlens=n, softmax_scale=scale, is_causal=T > 1,
          num_splits=splits)) if gpu else None, None if gpu else "needs a GPU")
  except ImportError as e:
    impls.update({name: (None, f"wheel absent: {e}") for name in _FA3})
  if T != 1:
    impls["pallas decode gqa"] = (None, "T = 1 only: it takes one query per sequence")
  else:
    try:
      gqa = _pallas_ops()[0].gqa
      k_splits = _k_splits(S, 16)
      impls["pallas decode gqa"] = (lambda q, k, v, n: gqa(
          q[:, 0], k, v, kv_seq_len=n, sm_scale=scale, k_splits=k_splits,
          interpret=not gpu)[:, None], None)
    except ImportError as e:
      impls["pallas decode gqa"] = (None, f"not importable: {e}")
  assert tuple(impls)[-len(CONTIGUOUS):] == CONTIGUOUS
  return impls


def paged_impls(case):
  """name -> (fn(q, k_pool, v_pool, lengths, block_table), None) or (None, why not).
  Pallas' paged_attention takes its pools heads-first (see bench_shape)."""
  B, S, N, K, H, T, _ = case
  scale = H ** -0.5
  gpu = _on_gpu()
  impls = {name: (_hopper_fn(blocks, paged=True), None)
           for name, blocks in _hopper_rows()}
  impls |= {name: (_triton_fn(tiles), None) for name, tiles in _triton_variants()}
  impls |= {
      OURS: (lambda q, k, v, n, t: js.decode_attention(
          q, k, v, n, block_table=t, implementation="triton"), None),
      "xla": (lambda q, k, v, n, t: js.decode_attention(
          q, k, v, n, block_table=t, implementation="xla"), None),
  }
  try:
    fa3 = _fa3_kvcache()
    for name, splits in zip(_FA3, FA3_SPLITS):
      impls[name] = ((lambda q, k, v, n, t, splits=splits: fa3(
          q, k, v, cache_seqlens=n, page_table=t, softmax_scale=scale, is_causal=T > 1,
          num_splits=splits)) if gpu else None, None if gpu else "needs a GPU")
  except ImportError as e:
    impls.update({name: (None, f"wheel absent: {e}") for name in _FA3})
  if T != 1:
    impls["pallas paged_attention"] = (None, "T = 1 only: it takes one query per sequence")
  else:
    try:
      paged_attention = _pallas_ops()[1].paged_attention

      def pallas_paged(q, k_heads, v_heads, n, t):
        # It takes no softmax scale (its logits are q·k): the caller scales q, timed.
        q = (q[:, 0] * scale).astype(q.dtype)
        return paged_attention(q, k_heads, v_heads, t, n,
                               k_splits=_k_splits(t.shape[1], 1), interpret=not gpu)[:, None]

      impls["pallas paged_attention"] = (pallas_paged, None)
    except ImportError as e:
      impls["pallas paged_attention"] = (None, f"not importable: {e}")
  assert tuple(impls)[-len(PAGED):] == PAGED
  return impls


def _splits_note(name, case, q, k, table):
  """The split count behind ours' row (`DecodeDims.of`, `mosaic_gpu.plan`, as the call
  chooses it)."""
  B, S, N, K, H, T, _ = case
  if name.startswith(HOPPER):
    blocks = dict(_hopper_variants()).get(name)
    why = mosaic_gpu.unsupported(q, k, table, blocks=blocks)
    if why is not None:
      return f"unsupported: {why}"
    plan = mosaic_gpu.plan(q, k, table, None, cores=pallas.num_cores(), blocks=blocks)
    schedule = "persistent" if plan.blocks.persistent else "grid"
    copies = f", {plan.copies} copies a block" if plan.copies > 1 else ""
    return (f"splits {plan.dims.splits}, blocks of {plan.block_k}, "
            f"{plan.blocks.num_stages} stages, {schedule}{copies}")
  if name.startswith(OURS):
    tiles = dict(_triton_variants()).get(name)
    dims = triton.DecodeDims.of(q, k, table, None, cores=pallas.num_cores(), tiles=tiles)
    gathered = ", pages gathered" if dims.gathers_pages else ""
    return (f"splits {dims.splits}, blocks of {dims.tiles.block_k}, "
            f"{dims.tiles.num_stages} stages{gathered}")
  return ""


def _measure(report, impls, args, *, note_of, mode, common, nbytes, truth, read):
  only = _env_list("DECODE_IMPLS")
  for name, (fn, why) in impls.items():
    if only is not None and name not in only:
      continue
    if fn is None:
      report.skip(impl=name, mode=mode, note=why, **common)
      continue
    report.measure(impl=name, mode=mode, fn=fn, arg_sets=[args], nbytes=nbytes,
                   truth=truth, ceiling_gbps=read, ceiling="read", note=note_of(name),
                   **common)


def bench_shape(report: harness.Report, case, dtype):
  B, S, N, K, H, T, page_sizes = case
  if _env_list("DECODE_PAGE_SIZES") is not None:
    page_sizes = tuple(int(p) for p in _env_list("DECODE_PAGE_SIZES"))
  q, k, v, lengths = case_inputs(case, dtype)
  nbytes = 2 * B * S * K * H * jnp.dtype(dtype).itemsize
  common = dict(op=f"decode T={T}", shape=(B, S, N, K, H), dtype=jnp.dtype(dtype).name)
  read = report.measure(impl="pallas read", mode="read", fn=lambda k, v: (
      harness.read_kernel(k), harness.read_kernel(v)), arg_sets=[(k, v)], nbytes=nbytes,
      ceiling="read", **{**common, "op": "ceiling"})
  truth = harness.float64_truth(
      lambda q, k, v, n: reference.decode_attention(q, k, v, n)[0], q, k, v, lengths)
  # One input set per row: every shape's K and V exceed twice L2 (`harness.rotations`).
  measure = dict(common=common, nbytes=nbytes, truth=truth, read=read)

  _measure(report, contiguous_impls(case), (q, k, v, lengths), mode="contiguous",
           note_of=lambda name: _splits_note(name, case, q, k, None), **measure)
  impls = paged_impls(case)
  for page_size in page_sizes:
    k_pool, table = paged_cache(k, page_size, seed=page_size)
    v_pool, _ = paged_cache(v, page_size, seed=page_size)
    note_of = lambda name, k_pool=k_pool, table=table: _splits_note(name, case, q, k_pool,
                                                                     table)
    ours_layout = {n: impl for n, impl in impls.items() if n != "pallas paged_attention"}
    _measure(report, ours_layout, (q, k_pool, v_pool, lengths, table),
             mode=f"paged {page_size}", note_of=note_of, **measure)
    # Pallas' paged_attention on the same pools, heads first: (K, pages, page_size, H).
    heads_first = [jnp.transpose(p, (2, 0, 1, 3)) if impls["pallas paged_attention"][0]
                   else p for p in (k_pool, v_pool)]
    del k_pool, v_pool
    _measure(report, {"pallas paged_attention": impls["pallas paged_attention"]},
             (q, *heads_first, lengths, table), mode=f"paged {page_size}", note_of=note_of,
             **measure)
    del heads_first


# A row whose relative error exceeds this many times the smallest of its shape's rows
# computes something else (as in bench_attention).
_WRONG = 10


def vs_best_peer(rows) -> str:
  """Markdown: for each shape and cache layout, each of our GB/s over the fastest peer's
  whose errors are right, by device time and end to end."""
  groups = {}
  for r in rows:
    if r.gbps is not None and r.op != "ceiling":
      groups.setdefault((r.op, r.shape, r.dtype, r.mode), []).append(r)
  lines = ["", "## Ours against the fastest peer", "",
           "Ratio of device time (and end-to-end time) of the fastest peer measured in the "
           "same run whose results are right (finite errors, a relative error at most "
           f"{_WRONG}x the smallest of the shape's rows) to ours: above 1, ours is faster.",
           "", "| op | shape | dtype | mode | ours | GB/s | % of read | best peer | its GB/s "
           "| ratio | e2e ratio |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for (op, shape, dtype, mode), group in groups.items():
    errs = [r.max_rel_err for r in group
            if r.max_rel_err is not None and np.isfinite(r.max_rel_err)]
    ours = [r for r in group if r.impl.startswith("jaxsoftmax ")]
    peers = [r for r in group if r not in ours and r.max_rel_err is not None
             and np.isfinite(r.max_rel_err) and r.max_rel_err <= _WRONG * min(errs)]
    if not peers or not ours:
      continue
    best = min(peers, key=lambda r: r.median_us)
    best_wall = min(r.wall_us for r in peers)
    for r in ours:
      lines.append(f"| {op} | {shape} | {dtype} | {mode} | {r.impl} | {r.gbps:.0f} | "
                   f"{r.pct_ceiling:.1f}% | {best.impl} | {best.gbps:.0f} | "
                   f"{best.median_us / r.median_us:.2f}x | {best_wall / r.wall_us:.2f}x |")
  return "\n".join(lines) + "\n"


def _rows(case, dtype, modes):
  # The read ceiling, then every contiguous implementation and every paged one at each
  # page size (a skipped one is a row too), our Hopper rows on a Hopper GPU.
  per_layout = len(_hopper_rows()) + len(_triton_variants())
  return 1 + (len(CONTIGUOUS) + per_layout) + (len(PAGED) + per_layout) * len(case[6])


if __name__ == "__main__":
  harness.run("decode_attention", __doc__, SHAPES, SMOKE_SHAPES, bench_shape, _rows,
              summary=vs_best_peer, default_modes="decode")
