"""The attention backward alone on the GPU: our Hopper backward's two designs (dQ by
atomic adds from the dK/dV kernel, and the deterministic one with a dQ kernel of its
own), our Triton backward, and the peers' backwards, on the same inputs in one run.

    PYTHONPATH=. python3 benchmarks/bench_attention_backward.py --out benchmarks/results

Each row times the pullback of one forward: `jax.vjp` runs the forward once, outside the
timed call, and the jitted call takes its residuals and dO and returns (dq, dk, dv). So
the rows compare what a backward costs given the residuals its own forward saved.
FLOPs: 2.5x the forward's 4·B·N·T·S·H (halved when causal): the five tile products of
a FlashAttention backward counted against the forward's two. Errors: the largest of the
dq, dk, dv errors against the float64 truth on batch row 0 and the query heads of K/V
head 0, as in bench_attention.py. Shapes: bench_attention.py's head-dim-128 and 64 ones,
and head dim 256 (the Hopper backward's wide design; deterministic calls there take the
Triton backward, and the row's label says so); then (--only 6,7) GQA causal, 32 query
heads over 8 K/V heads, beside 32 heads of their own at the same FLOPs, which tells what
walking a head group costs the Hopper backward from what every step costs; then (--only
8,9) MLA's head dims (H 192, Hv 128), causal and not, where the split-keys design runs
unless the schedule has "wide" (`split_keys_width`); then (--only 10,11,12) head dim 64
causal, GQA 32/8 without a mask and GQA 32/4 causal at 2x8192; then (--only 13-18) the
GQA sweep of `heads_per_cta`; then (--only 19,20) head dim 256 causal, MHA and GQA 32/8;
then (--only 21) 4x4096 causal in float16.

HOPPER_BWD_SCHEDULES (comma-separated; each a "+"-joined set of `SCHEDULE_FLAGS`, e.g.
"stale,fa3,nofa3,wide,stale+det,ordered+det") adds a row of the Hopper backward per
schedule: the default `HopperBackwardBlockSizes` with those fields changed ("det" for
deterministic=True), named "jaxsoftmax mosaic_gpu fa3". The sweep that chose today's
default: benchmarks/results/tuning/attention_backward_schedules.md. BWD_ROWS
(comma-separated row names, e.g. "jaxsoftmax mosaic_gpu,fa3") keeps only those of the
other rows, to spend less device time on a sweep. BENCH_ROUNDS=2 times a shape's rows in
two rounds, the second in the reverse order (`harness.Report.measure_rounds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp

import harness
from bench_attention import (MLA_SHAPES, MORE_TARGET_SHAPES, OURS, TARGET_SHAPES,
                             case_inputs, dims, fwd_bwd, implementations, kept,
                             truth_slices, vs_best_peer)
import jaxsoftmax as js
from jaxsoftmax.attention.mosaic_gpu import backward as mosaic_backward

# (--only 13-18) GQA over group sizes 2-16, sequence lengths and head dims: the sweep
# that sets how many query heads of a group a dK/dV CTA walks (`heads_per_cta`), with
# --only 6, 11 and 12 (HOPPER_BWD_SCHEDULES=hpc1,hpc2,hpc4: at most 1, 2, 4 heads a
# CTA; hpcall: the whole group). 1x16384 32/4 is not among them: its float64 truth
# (8 query heads of 16384 x 16384) ran out of an H100's memory.
GQA_SWEEP_SHAPES = [((4, 4096, 32, 16, 128, True), jnp.bfloat16),
                    ((2, 8192, 32, 8, 128, True), jnp.bfloat16),
                    ((4, 4096, 32, 4, 128, True), jnp.bfloat16),
                    ((2, 8192, 64, 4, 128, True), jnp.bfloat16),
                    ((2, 8192, 32, 4, 128, False), jnp.bfloat16),
                    ((8, 2048, 32, 4, 64, True), jnp.bfloat16)]
# (--only 19,20) head dim 256 causal, MHA and GQA 32/8: the wide design's masked steps,
# where its spills sat (benchmarks/results/tuning/ptxas_attention_offline.md).
WIDE_MASKED_SHAPES = [((2, 8192, 16, 16, 256, True), jnp.bfloat16),
                      ((4, 4096, 32, 8, 256, True), jnp.bfloat16)]
# (--only 21) 4x4096 causal in float16, whose backward spills where bfloat16's does not
# (offline 112 / 128 bytes against 8 / 4: ptxas_attention_offline.md): the case for
# `fresh_mask_offsets` (HOPPER_BWD_SCHEDULES=fmask) outside GQA.
FLOAT16_SHAPES = [((4, 4096, 16, 16, 128, True), jnp.float16)]
SHAPES = TARGET_SHAPES + [((4, 4096, 32, 8, 128, True), jnp.bfloat16),
                          ((4, 4096, 32, 32, 128, True), jnp.bfloat16),
                          *MLA_SHAPES, *MORE_TARGET_SHAPES, *GQA_SWEEP_SHAPES,
                          *WIDE_MASKED_SHAPES, *FLOAT16_SHAPES]
SMOKE_SHAPES = [((1, 64, 2, 1, 32, True), jnp.bfloat16)]
# Our rows: bench_attention's names, with the implementation and determinism each asks
# for; the row's label names the backward that runs (`our_backward`).
OUR_ROWS = {f"{OURS} mosaic_gpu": ("mosaic_gpu", False),
            f"{OURS} mosaic_gpu deterministic": ("mosaic_gpu", True),
            f"{OURS} triton": ("triton", False)}
PEERS = ("cudnn", "fa3", "tokamax mosaic")
# HOPPER_BWD_SCHEDULES' flags: the `HopperBackwardBlockSizes` field each one sets, and
# its value (stale: the tile addresses LLVM hoists, and ptxas spills, as before the
# default took fresh ones; wide: MLA's head dims in the wide design).
SCHEDULE_FLAGS = {"stale": ("fresh_tile_addresses", False),
                  "fmask": ("fresh_mask_offsets", True),
                  "fa3": ("fa3_step_order", True), "nofa3": ("fa3_step_order", False),
                  "wide": ("split_keys_width", 2 * mosaic_backward.SPLIT_KEYS_HEAD_DIM),
                  "ordered": ("ordered_dq_adds", True),
                  "dqkernel": ("ordered_dq_adds", False),
                  "writer": ("dq_writer_warp", True), "nowriter": ("dq_writer_warp", False),
                  "stage2": ("dq_staging_tiles", 2), "l2": ("l2_sections", True),
                  "late": ("late_dq", True), "nolate": ("late_dq", False),
                  "nolateband": ("late_dq_banded", False),
                  "hpc1": ("heads_per_cta", 1),
                  "hpc2": ("heads_per_cta", 2), "hpc4": ("heads_per_cta", 4),
                  "hpcall": ("heads_per_cta", None),
                  "warpgroup": ("one_producer_warp", False)}


def parse_schedule(spec: str) -> tuple[mosaic_backward.HopperBackwardBlockSizes, bool]:
  """(the Hopper backward's blocks, deterministic) of a schedule such as "stale+fa3"."""
  flags = spec.split("+")
  unknown = set(flags) - {*SCHEDULE_FLAGS, "det"}
  if unknown:
    raise ValueError(f"unknown schedule flags {sorted(unknown)} in {spec!r}; known: "
                     f"{sorted(SCHEDULE_FLAGS)} and det")
  blocks = dataclasses.replace(mosaic_backward.BLOCKS,
                               **dict(SCHEDULE_FLAGS[f] for f in flags if f != "det"))
  return blocks, "det" in flags


def schedules() -> dict[str, tuple[mosaic_backward.HopperBackwardBlockSizes, bool]]:
  """Row suffix -> `parse_schedule` of each of HOPPER_BWD_SCHEDULES."""
  specs = filter(None, os.environ.get("HOPPER_BWD_SCHEDULES", "").split(","))
  return {spec: parse_schedule(spec) for spec in specs}


def our_backward(name: str, q, k, v, causal: bool) -> str:
  """What differentiates our row ``name`` at these inputs (`js.attention_kernels`)."""
  implementation, deterministic = OUR_ROWS[name]
  _, backward = js.attention_kernels(q, k, v, is_causal=causal,
                                     implementation=implementation,
                                     deterministic=deterministic)
  if backward != "mosaic_gpu":
    return {"triton": "Triton backward"}.get(backward, f"{backward} backward")
  pads = [mosaic_backward.wgmma_head_dim(x.shape[-1]) for x in (q, v)]
  if deterministic and not mosaic_backward.BLOCKS.orders_dq_adds(*pads):
    return "Hopper backward, dQ kernel"
  return "Hopper backward, dQ by atomic adds" + (" in a fixed order" if deterministic else "")


def _pullback(vjp, do):
  return vjp(do)


def bench_shape(report: harness.Report, case, dtype):
  B, T, N, K, H, causal, _ = dims(case)
  part_q, part_kv, compare_bwd, ref = truth_slices(case)
  (q, k, v, do), common, flops = case_inputs(case, dtype)
  truth = harness.float64_truth(fwd_bwd(ref), part_q(q), part_kv(k), part_kv(v), part_q(do))
  impls = implementations(N, K, H, causal)
  rows = [(name, name, None)
          for name in kept(dict.fromkeys((*OUR_ROWS, *PEERS)), "BWD_ROWS")]
  for suffix, (blocks, deterministic) in schedules().items():
    name = f"{OURS} mosaic_gpu" + " deterministic" * deterministic
    rows.append((name, f"{OURS} mosaic_gpu {suffix}", blocks))
  timed = []
  for name, impl, blocks in rows:
    attention, why = impls[name]
    if attention is None:
      report.skip(impl=impl, mode="bwd", note=why, **common)
      continue
    context = functools.partial(_blocks, blocks or mosaic_backward.BLOCKS)
    try:
      with context():
        _, vjp = jax.vjp(jax.jit(attention), q, k, v)
        if name in OUR_ROWS:  # the label names the backward these blocks pick
          impl = f"{impl} ({our_backward(name, q, k, v, causal)})"
    except Exception as e:  # noqa: BLE001 - a peer that fails is a result, not a crash
      report.skip(impl=impl, mode="bwd", note=harness.failure_note(e), **common)
      continue
    timed.append(dict(mode="bwd", impl=impl, fn=_pullback, arg_sets=[(vjp, do)],
                      flops=flops * 2.5, truth=truth, compare=compare_bwd,
                      context=context, **common))
  # In interleaved rounds where BENCH_ROUNDS asks (harness.Report.measure_rounds).
  report.measure_rounds(timed)


@contextlib.contextmanager
def _blocks(blocks: mosaic_backward.HopperBackwardBlockSizes):
  """The Hopper backward's blocks set to ``blocks`` while a row's pullback traces (it
  reads `mosaic_backward.BLOCKS` then), the default's again after."""
  default = mosaic_backward.BLOCKS
  mosaic_backward.BLOCKS = blocks
  try:
    yield
  finally:
    mosaic_backward.BLOCKS = default


if __name__ == "__main__":
  harness.run("attention_backward", __doc__, SHAPES, SMOKE_SHAPES, bench_shape,
              lambda case, dtype, modes: len(OUR_ROWS) + len(PEERS) + len(schedules()),
              unit="TFLOP/s",
              summary=vs_best_peer,
              flops_doc="2.5 · 4·B·N·T·S·H (halved when causal): the backward's")
