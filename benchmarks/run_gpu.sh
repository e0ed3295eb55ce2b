#!/usr/bin/env bash
# The one command for the GPU machine: GPU-marked tests, then the benchmarks, with every
# log and result under $OUT (default benchmarks/results/run). Run from the repo root:
#
#   STAGES="tests tune bench" bash benchmarks/run_gpu.sh
#   bash benchmarks/run_gpu.sh --help        # this text: the stages and their options
#
# Stages (each bounded by a timeout, so that one hung stage still leaves the others'
# results; everything is also packed into $OUT/run.tgz, since only a few files come back
# from the machine; PACK_ONLY=1 leaves only that archive and summary.log under $OUT):
#   tests, tune, bench      pytest -m gpu; tune_rows.py; bench_softmax.py (ROWS_ONLY picks
#                           shapes, ROWS_NAME names the results, ROWS_MODES="fwd,fwd+bwd,bwd"
#                           adds the backward alone) and
#                           bench_cross_entropy.py (CE_ONLY picks shapes)
#   rows-profile            profile_rows.py: a row op's or a norm's kernels and gaps per
#                           call, ours and XLA's (ROWS_OPS="softmax,logsumexp" or
#                           "layer_norm,rms_norm"; ROWS_ONLY picks that family's shapes;
#                           ROWS_MODES, default "fwd,fwd+bwd")
#   attn-tests              pytest -m gpu tests/test_attention.py (TEST_K picks tests,
#                           TEST_WORKERS workers, default 12; TEST_TIMEOUT); each test's
#                           seconds in attn_test_times.log (lce-tests, pytest: likewise);
#                           JAXSOFTMAX_TESTS_DONE=that log leaves out, in the next call,
#                           the tests it records as passed or skipped (tests/conftest.py)
#   attn-tune               tune_attention.py (TUNE_ONLY="4,5" picks shapes)
#   attn-tune-hopper        tune_attention_hopper.py: the Mosaic GPU forward's tiles
#                           (TUNE_ONLY picks shapes, TUNE_TILINGS="0,4" its tilings)
#   attn-bench              bench_attention.py (ATTN_ONLY="0,1" picks shapes, ATTN_NAME
#                           names the results, ATTN_MODES="fwd" measures the forward alone,
#                           ATTN_ROWS="jaxsoftmax mosaic_gpu,cudnn" keeps only those rows,
#                           timed in that order; BENCH_ROUNDS=2 times each shape's rows
#                           in two rounds, the second in reverse order (attn-bench-bwd
#                           too: harness.Report.measure_rounds);
#                           HOPPER_FWD_SCHEDULES="dynamic" adds rows of the Hopper
#                           forward's schedules, "jaxsoftmax mosaic_gpu dynamic", which
#                           ATTN_ROWS must name too where it is set; ATTN_TIMEOUT,
#                           default 540 s, bounds it: its tables are written row by row)
#   attn-bench-bwd          bench_attention_backward.py: the backwards alone (ATTN_ONLY;
#                           HOPPER_BWD_SCHEDULES adds rows of the Hopper backward's
#                           schedules, e.g. "stale,fa3,wide,stale+det"; BWD_ROWS keeps
#                           only those of the other rows; ATTN_TIMEOUT, default 400 s)
#   attn-features           bench_attention_features.py: sinks, ALiBi, bias and mask
#                           arrays against the plain kernels and cuDNN (ATTN_ONLY;
#                           ATTN_MODES="fwd,fwd+bwd,jvp" adds forward mode; ATTN_FEATURES
#                           picks features; ATTN_NAME names the results; ATTN_TIMEOUT,
#                           default 400 s: four features
#                           on both shapes took longer on 2026-12-05)
#   attn-planes             plane_tile_stages.py: the Triton forward's stages with a mask
#                           or bias tile, plain and at tiles that keep them (ATTN_ONLY)
#   attn-kernels            profile_attention_kernels.py: each implementation's kernels
#                           per call, the attention kernels and those around them
#                           (ATTN_ONLY, ATTN_MODES, ATTN_NAME; ATTN_IMPLS picks them)
#   attn-delta              bench_delta.py: the backward's delta and zeroed dQ, by XLA
#                           and by a Pallas kernel, and whether each is the same under
#                           vmap (DELTA_ARGS: its arguments)
#   attn-ncu                Nsight Compute counters of one forward (NCU_SOURCE=1 adds the
#                           per-instruction stall samples on the SASS, summed up by
#                           ncu_stalls.py)
#   attn-resources          ptxas' registers and spills of the Mosaic GPU kernels
#                           (PROFILE_SHAPES picks shapes)
#   example                 the transformer example at GPU size, with its profiler trace
#   accuracy-rows           the row ops' errors beside XLA's over many seeds
#                           (accuracy_rows.py)
#   command-buffers         a training step with XLA's command buffers on and off, and
#                           which thunks they hold (command_buffers.py)
#   ring-tests, ring-bench  context parallelism on every visible GPU (RING_ONLY picks
#                           shapes, RING_NAME names the results)
#   ring-profile            the gaps between back-to-back calls (profile_ring_attention.py)
#                           with the GPUs' clocks and power
#   ring-example            examples/long_context.py on every visible GPU
#   pytest                  any tests: PYTEST_ARGS (files, -k), TEST_TIMEOUT
#   lce-tests, lce-bench    linear_cross_entropy (LCE_ONLY picks shapes, LCE_NAME names
#                           the results); tune-lce sweeps its forward's tiles (LCE_ONLY);
#                           lce-profile: a training step's kernels grouped by name
#                           (profile_linear_cross_entropy.py, LCE_ONLY); lce-accuracy:
#                           the float32 accumulation error of its products and XLA's
#                           (accuracy_linear_cross_entropy.py)
#   norm-tests, norm-bench  layer_norm, rms_norm (NORM_ONLY picks shapes, NORM_MODES as
#                           ROWS_MODES, plus "step": the backward through y @ w);
#                           tune-norms sweeps their tiles (TUNE_NORM_PARAMS=float32: with
#                           float32 scale and bias; NORM_MODES="fwd" or "bwd" sweeps one
#                           kernel); norm-ncu: the backward kernel's counters
#                           (profile_norms.py)
#   decode-tests            pytest -m gpu tests/test_decode_attention.py
#   decode-bench            bench_decode_attention.py: decode_attention beside XLA, cuDNN,
#                           FA3 and Pallas' decode kernels, contiguous and paged caches
#                           (DECODE_ONLY="0,1" picks shapes, DECODE_NAME names the results)
#   decode-ncu              Nsight Compute counters of decode steps, ours and cuDNN's
#                           (DECODE_PROFILES="mosaic_gpu 64,4096,32,8,128,1;triton ...")
#
# The attention peers FA3 and tokamax come as wheels placed in .peers (git-ignored; carry
# it to the machine); they are installed under /tmp for the run.
#
# A change against the code before it, in one call on one machine: BASELINE=baseline
# has the benchmark scripts and the test stages import jaxsoftmax from that folder, not
# the repo's (git-ignored; write it with `rm -rf baseline && mkdir baseline && git
# archive REF jaxsoftmax | tar -x -C baseline` and carry it), with its own OUT so that
# the two archives both come back:
#   STAGES=attn-bench ATTN_NAME=x_new OUT=$OUT/new bash benchmarks/run_gpu.sh
#   BASELINE=baseline STAGES=attn-bench ATTN_NAME=x_base OUT=$OUT/base bash benchmarks/run_gpu.sh
set -uo pipefail
stages=${STAGES:-tests tune bench}
known="tests tune bench rows-profile attn-tests attn-tune attn-tune-hopper attn-bench
  attn-bench-bwd attn-features attn-planes attn-kernels attn-delta attn-ncu attn-resources pytest lce-tests lce-bench lce-profile lce-accuracy
  tune-lce norm-tests norm-bench tune-norms norm-ncu decode-tests decode-bench decode-ncu ring-tests
  ring-bench ring-profile ring-example accuracy-rows command-buffers example"
if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then
  sed -n '2,/^$/{s/^# \{0,1\}//;/^set /q;p}' "$0"
  exit 0
fi
# Every stage named must exist before any runs: a typo should not cost a machine's time.
for stage in $stages; do
  case " $(echo $known) " in
    *" $stage "*) ;;
    *) echo "unknown stage '$stage'; bash benchmarks/run_gpu.sh --help lists them" >&2; exit 2 ;;
  esac
done
# Only a few files come back from the machine: the logs and results go to $OUT/run and
# come back packed in $OUT/run.tgz, with the one-line-per-stage summary beside it. The
# device tool brings back the first 8 files it finds under its $OUT, so that with two
# runs' folders under it the second's archive may stay behind: PACK_ONLY=1 writes the
# logs outside $OUT, leaving run.tgz and summary.log alone there.
top=${OUT:-benchmarks/results/run}
if [ "${PACK_ONLY:-0}" = 1 ]; then out=$(mktemp -d); else out=$top/run; fi
mkdir -p "$top" "$out"
python=${PYTHON:-python3}
export PYTHONPATH=${BASELINE:+$(realpath "$BASELINE"):}$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
# pytest (python -m) and its xdist workers (python -c) put the working directory, and so
# the repo's jaxsoftmax, ahead of PYTHONPATH; PYTHONSAFEPATH (Python 3.11+) leaves it off.
if [ -n "${BASELINE:-}" ]; then export PYTHONSAFEPATH=1; fi
export PYTHONUNBUFFERED=1

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  $python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  # -P: the jaxsoftmax that PYTHONPATH finds, as the scripts do, not the working directory's
  $python -P -c "import jaxsoftmax; print('jaxsoftmax from', jaxsoftmax.__path__[0])"
} 2>&1 | tee "$out/env.log"

if ls .peers/*.whl >/dev/null 2>&1; then
  $python -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers \
    .peers/*.whl > "$out/peers.log" 2>&1 || echo "peer wheels did not install" | tee -a "$out/env.log"
  export PYTHONPATH=$PYTHONPATH:$PWD/.peers/stubs:/tmp/peers
fi

pack() { tar -czf "$top/run.tgz" -C "$out" . && cp "$out/summary.log" "$top/"; }

# counters LOG KERNEL_REGEX LABEL COMMAND...: Nsight Compute on the second launch of the
# kernels KERNEL_REGEX selects (the first compiles), its report in LOG, and the lines
# that say what limits the kernel (throughput, pipes, stalls, registers, occupancy)
# labelled into the summary. KERNEL_REGEX matches demangled names (a CUTLASS kernel's
# class, e.g. FA3's FlashAttnBwdSm90, is a template argument). NCU_SOURCE=1 also
# samples the stalls per instruction and writes the SASS with them (LOG with
# .sass.log): where spills and waits sit.
counters() {
  local log=$1 kernel=$2 label=$3
  shift 3
  local source=()
  [ "${NCU_SOURCE:-0}" = 1 ] && source=(--section SourceCounters --export "${log%.log}")
  # Without XLA's command buffers: ncu skips every kernel of a CUDA graph that may hold
  # conditional nodes, which a call with a mask array makes (its lax.switch,
  # api._mask_as_lengths), so on 2026-12-05 it profiled none of our masked forward.
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer=" \
    timeout 150 ncu --clock-control none --launch-skip 1 --launch-count 1 \
    --kernel-name-base demangled -k "regex:$kernel" \
    --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section LaunchStats --section MemoryWorkloadAnalysis "${source[@]}" "$@" > "$log" 2>&1
  if [ "${NCU_SOURCE:-0}" = 1 ]; then
    ncu --import "${log%.log}.ncu-rep" --page details >> "$log" 2>&1
    ncu --import "${log%.log}.ncu-rep" --page source --print-source sass --csv \
      > "${log%.log}.sass.log" 2>&1
    rm -f "${log%.log}.ncu-rep"
    # Where the warps wait, by reason and by instruction (the SASS table is too large to
    # come back from the machine alone).
    $python benchmarks/ncu_stalls.py "${log%.log}.sass.log" > "${log%.log}.stalls.log" 2>&1
    sed -n '3,5p' "${log%.log}.stalls.log" | sed "s/^/$label: /" | tee -a "$out/summary.log"
  fi
  grep -E "^  [a-z_]|Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Issued Ipc|No Eligible|Stall|Tensor|Local|Achieved Occupancy" \
    "$log" | head -n 30 | sed "s/^/$label: /" | tee -a "$out/summary.log"
}

for stage in $stages; do
  echo "=== $stage $(date -u +%T)" | tee -a "$out/summary.log"
  case $stage in
    tests)
      # Four workers share the GPU: each may take a fifth of its memory.
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout 150 $python -m pytest -m gpu -q -n 4 \
        -p no:cacheprovider -rfE tests 2>&1 | tee "$out/tests.log" | tail -n 25 \
        | tee -a "$out/summary.log" ;;
    tune)
      timeout 270 $python benchmarks/tune_rows.py --out "$out" 2>&1 \
        | tee "$out/tune.log" | tail -n 3 | tee -a "$out/summary.log" ;;
    bench)
      timeout 300 $python benchmarks/bench_softmax.py --out "$out" \
        ${ROWS_ONLY:+--only "$ROWS_ONLY"} ${ROWS_NAME:+--name "$ROWS_NAME"} \
        ${ROWS_MODES:+--modes "$ROWS_MODES"} 2>&1 \
        | tee "$out/bench.log"
      timeout 120 $python benchmarks/bench_cross_entropy.py --out "$out" \
        ${CE_ONLY:+--only "$CE_ONLY"} 2>&1 | tee -a "$out/bench.log"
      tail -n 2 "$out/bench.log" | tee -a "$out/summary.log" ;;
    rows-profile)
      timeout 300 $python benchmarks/profile_rows.py --out "$out" \
        ${ROWS_ONLY:+--only "$ROWS_ONLY"} ${ROWS_OPS:+--ops "$ROWS_OPS"} \
        ${ROWS_MODES:+--modes "$ROWS_MODES"} > "$out/rows_profile.log" 2>&1
      grep "^## \|^Span" "$out/rows_profile.log" | tee -a "$out/summary.log" ;;
    attn-tests)
      # Compiling dominates, so TEST_WORKERS (default 12) workers on the 16 cores, each
      # allocating GPU memory as it goes (eight preallocating 11% each left the driver
      # too little to instantiate CUDA graphs). TEST_K="expr" selects tests (pytest -k);
      # TEST_TIMEOUT: seconds (default 330). On an H100 on 2026-12-05, twelve workers: 34
      # tests in 76 s; then 119 of the other 169 in 520 s, test_matches_truth_gpu taking
      # 50-250 s a case on a worker (Triton's float32 cases at head dims 192-256 the
      # slowest; compiling, by our reading: its shapes are small), as
      # attn_test_times.log records.
      JAXSOFTMAX_TEST_TIMES=$out/attn_test_times.log \
        XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.11 \
        timeout ${TEST_TIMEOUT:-330} $python -m pytest \
        -m gpu -v -n ${TEST_WORKERS:-12} -p no:cacheprovider -rfEs ${TEST_K:+-k "$TEST_K"} \
        tests/test_attention.py 2>&1 \
        | tee "$out/attn_tests.log" | tail -n 25 | tee -a "$out/summary.log" ;;
    attn-tune)
      timeout 300 $python benchmarks/tune_attention.py --out "$out" \
        ${TUNE_ONLY:+--only "$TUNE_ONLY"} 2>&1 \
        | tee "$out/attn_tune.log" | tail -n 3 | tee -a "$out/summary.log" ;;
    attn-tune-hopper)
      timeout 330 $python benchmarks/tune_attention_hopper.py --out "$out" \
        ${TUNE_ONLY:+--only "$TUNE_ONLY"} 2>&1 \
        | tee "$out/attn_tune_hopper.log" | tail -n 3 | tee -a "$out/summary.log" ;;
    attn-bench)
      timeout ${ATTN_TIMEOUT:-540} $python benchmarks/bench_attention.py --out "$out" \
        ${ATTN_ONLY:+--only "$ATTN_ONLY"} --name "${ATTN_NAME:-attention}" \
        --modes "${ATTN_MODES:-fwd,fwd+bwd}" 2>&1 \
        | tee -a "$out/attn_bench.log" | tail -n 2 | tee -a "$out/summary.log" ;;
    attn-bench-bwd)
      timeout ${ATTN_TIMEOUT:-400} $python benchmarks/bench_attention_backward.py --out "$out" \
        ${ATTN_ONLY:+--only "$ATTN_ONLY"} 2>&1 \
        | tee -a "$out/attn_bench_bwd.log" | tail -n 2 | tee -a "$out/summary.log" ;;
    attn-features)
      # Device time from jax.profiler traces (BENCH_TIMER, harness.py): CUPTI's reader
      # aborted the whole run at the first Hopper row with a mask (2026-12-05), whose
      # kernels sit in a CUDA graph with conditional nodes (api._mask_as_lengths).
      BENCH_TIMER=${BENCH_TIMER:-trace} timeout ${ATTN_TIMEOUT:-400} $python benchmarks/bench_attention_features.py --out "$out" \
        ${ATTN_ONLY:+--only "$ATTN_ONLY"} ${ATTN_MODES:+--modes "$ATTN_MODES"} \
        --name "${ATTN_NAME:-attention_features}" 2>&1 \
        | tee -a "$out/attn_features.log" | tail -n 2 | tee -a "$out/summary.log" ;;
    attn-kernels)
      # A jax.profiler trace a call: the kernels' names and microseconds, no counters.
      timeout ${ATTN_TIMEOUT:-400} $python benchmarks/profile_attention_kernels.py --out "$out" \
        ${ATTN_ONLY:+--only "$ATTN_ONLY"} ${ATTN_MODES:+--modes "$ATTN_MODES"} \
        ${ATTN_IMPLS:+--impls "$ATTN_IMPLS"} --name "${ATTN_NAME:-profile_attention_kernels}" \
        > "$out/attn_kernels.log" 2>&1; tail -n 3 "$out/attn_kernels.log" | tee -a "$out/summary.log" ;;
    attn-delta)
      # DELTA_ARGS: its arguments, e.g. "--shape 4,300,16,128 --o-dtype float32".
      eval "delta_args=(${DELTA_ARGS:-})"
      timeout 120 $python benchmarks/bench_delta.py "${delta_args[@]}" > "$out/attn_delta.log" 2>&1
      cat "$out/attn_delta.log" | tee -a "$out/summary.log" ;;
    attn-planes)
      # The Triton forward's pipeline stages against a mask or bias tile
      # (plane_tile_stages.py; ATTN_ONLY picks shapes), with the trace timer as above.
      BENCH_TIMER=${BENCH_TIMER:-trace} timeout ${ATTN_TIMEOUT:-400} $python benchmarks/plane_tile_stages.py --out "$out" \
        ${ATTN_ONLY:+--only "$ATTN_ONLY"} 2>&1 \
        | tee -a "$out/attn_planes.log" | tail -n 2 | tee -a "$out/summary.log" ;;
    attn-ncu)
      # Nsight Compute on one forward of each of PROFILE_IMPLS (default: ours on Hopper
      # and cuDNN) at PROFILE_SHAPE: throughput, tensor-pipe use, stall reasons.
      # PROFILE_MODE=fwd+bwd runs the backward too (PROFILE_KERNEL then picks its kernels).
      # PROFILE_FEATURE names one of bench_attention_features.py's features ("alibi",
      # "bias heads", "mask", ...; logs named ncu_IMPL_bias_heads.log); PROFILE_SCHEDULE (e.g.
      # stale+fa3) picks the Hopper backward's schedule, and names the logs
      # ncu_IMPL_stale_fa3.log; PROFILE_FORWARD (e.g. dynamic) the Hopper forward's flags
      # (profile_attention.py --forward; PROFILE_IMPLS=mosaic_gpu).
      tag=$(echo "${PROFILE_FEATURE:+_$PROFILE_FEATURE}${PROFILE_SCHEDULE:+_$PROFILE_SCHEDULE}${PROFILE_FORWARD:+_$PROFILE_FORWARD}" | tr '+ ' '__')
      for impl in ${PROFILE_IMPLS:-mosaic_gpu cudnn}; do
        counters "$out/ncu_$impl$tag.log" "${PROFILE_KERNEL:-attention|fmha|flash|sm90}" "$impl" \
          $python benchmarks/profile_attention.py --impl "$impl" \
          --shape "${PROFILE_SHAPE:-4,4096,16,16,128,0}" --mode "${PROFILE_MODE:-fwd}" \
          ${PROFILE_FEATURE:+--feature "$PROFILE_FEATURE"} ${PROFILE_SCHEDULE:+--schedule "$PROFILE_SCHEDULE"} \
          ${PROFILE_FORWARD:+--forward "$PROFILE_FORWARD"}
      done ;;
    attn-resources)
      # ptxas' report (registers, spilled bytes) and the SASS of the Mosaic GPU kernels
      # that one forward + backward compiles at each ;-separated PROFILE_SHAPES (Mosaic
      # GPU's MOSAIC_GPU_DUMP_* switches); the SASS shows where the spills sit.
      # PROFILE_SCHEDULE picks the backward's schedule, as in attn-ncu. Without a GPU,
      # benchmarks/resources_offline.sh reports the same ptxas figures.
      IFS=';' read -ra shapes <<< "${PROFILE_SHAPES:-4,4096,16,16,128,0;4,4096,16,16,128,1;2,8192,16,16,256,0}"
      for shape in "${shapes[@]}"; do
        log="$out/ptxas_$(echo "$shape${PROFILE_SCHEDULE:+_$PROFILE_SCHEDULE}" | tr ',+' 'x_').log"
        MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 timeout 120 $python \
          benchmarks/profile_attention.py --impl mosaic_gpu --shape "$shape" \
          --mode fwd+bwd ${PROFILE_SCHEDULE:+--schedule "$PROFILE_SCHEDULE"} > "$log" 2>&1
        grep -iE "Compiling entry|spill|Used [0-9]+ registers|error" "$log" \
          | head -n 20 | sed "s/^/$shape: /" | tee -a "$out/summary.log"
      done ;;
    pytest)
      # Any tests: PYTEST_ARGS (e.g. "tests/test_norms.py -k 'online or rows'"), on the
      # GPU; split into words as the shell splits a command line, quotes included. Each
      # process allocates GPU memory as it goes, so that PYTEST_ARGS may take workers
      # (-n 8 preallocating ran out of memory at collection on 2026-12-07).
      eval "pytest_args=(${PYTEST_ARGS:-})"
      JAXSOFTMAX_TEST_TIMES=$out/pytest_times.log XLA_PYTHON_CLIENT_PREALLOCATE=false \
        timeout ${TEST_TIMEOUT:-300} $python -m pytest -q -p no:cacheprovider -rfEs \
        "${pytest_args[@]}" 2>&1 | tee -a "$out/pytest.log" | tail -n 6 \
        | tee -a "$out/summary.log" ;;
    lce-tests)
      # Compiling dominates (196 s on 4 workers before the 18 extreme-input cases came;
      # cut at 330 s on 4 workers on 2026-12-05): TEST_WORKERS (default 8) workers, each
      # allocating GPU memory as it goes, as attn-tests does. TEST_TIMEOUT (default 420).
      JAXSOFTMAX_TEST_TIMES=$out/lce_test_times.log XLA_PYTHON_CLIENT_PREALLOCATE=false \
        timeout ${TEST_TIMEOUT:-420} $python -m pytest \
        -m gpu -v -n ${TEST_WORKERS:-8} -p no:cacheprovider -rfEs tests/test_linear_cross_entropy.py 2>&1 | tee "$out/lce_tests.log" | tail -n 6 \
        | tee -a "$out/summary.log" ;;
    lce-bench)
      timeout 400 $python benchmarks/bench_linear_cross_entropy.py --out "$out" \
        ${LCE_ONLY:+--only "$LCE_ONLY"} ${LCE_NAME:+--name "$LCE_NAME"} 2>&1 \
        | tee "$out/lce_bench.log" | tail -n 3 | tee -a "$out/summary.log" ;;
    lce-profile)
      timeout 300 $python benchmarks/profile_linear_cross_entropy.py --out "$out" \
        ${LCE_ONLY:+--only "$LCE_ONLY"} > "$out/lce_profile.log" 2>&1
      grep -m 4 "Kernel time" "$out/lce_profile.log" | tee -a "$out/summary.log" ;;
    lce-accuracy)
      timeout 200 $python benchmarks/accuracy_linear_cross_entropy.py --out "$out" 2>&1 \
        | tail -n 12 | tee -a "$out/summary.log" ;;
    tune-lce)
      timeout 400 $python benchmarks/tune_linear_cross_entropy.py --out "$out" \
        ${LCE_ONLY:+--only "$LCE_ONLY"} 2>&1 \
        | tee "$out/tune_lce.log" | tail -n 3 | tee -a "$out/summary.log" ;;
    norm-tests)
      timeout 300 $python -m pytest -m gpu -q -p no:cacheprovider -rfEs \
        tests/test_norms.py 2>&1 | tee "$out/norm_tests.log" | tail -n 6 \
        | tee -a "$out/summary.log" ;;
    norm-bench)
      timeout 400 $python benchmarks/bench_norms.py --out "$out" \
        ${NORM_ONLY:+--only "$NORM_ONLY"} ${NORM_MODES:+--modes "$NORM_MODES"} 2>&1 \
        | tee "$out/norm_bench.log" | tail -n 3 \
        | tee -a "$out/summary.log" ;;
    tune-norms)
      timeout 400 $python benchmarks/tune_norms.py --out "$out" ${NORM_MODES:+--modes "$NORM_MODES"} \
        ${NORM_ONLY:+--only "$NORM_ONLY"} 2>&1 | tee "$out/tune_norms.log" | tail -n 3 \
        | tee -a "$out/summary.log" ;;
    norm-ncu)
      # Nsight Compute on the norms' backward kernel (NORM_KERNEL picks another) for each
      # ;-separated argument list of NORM_PROFILES (profile_norms.py's arguments).
      IFS=';' read -ra profiles <<< "${NORM_PROFILES:---shape 65536,1024;--shape 8192,16384 --dtype float32 --residual}"
      for i in "${!profiles[@]}"; do
        counters "$out/ncu_norms_$i.log" "${NORM_KERNEL:-norm_bwd}" "norms $i" \
          $python benchmarks/profile_norms.py ${profiles[$i]}
      done ;;
    decode-tests)
      timeout 300 $python -m pytest -m gpu -q -p no:cacheprovider -rfEs \
        tests/test_decode_attention.py 2>&1 | tee "$out/decode_tests.log" | tail -n 6 \
        | tee -a "$out/summary.log" ;;
    decode-bench)
      timeout 400 $python benchmarks/bench_decode_attention.py --out "$out" \
        ${DECODE_ONLY:+--only "$DECODE_ONLY"} ${DECODE_NAME:+--name "$DECODE_NAME"} 2>&1 \
        | tee -a "$out/decode_bench.log" | tail -n 3 | tee -a "$out/summary.log" ;;
    decode-ncu)
      # Nsight Compute on one decode step of each ;-separated DECODE_PROFILES entry
      # ("impl B,S,N,K,H,T [page_size [tiles]]"; impl mosaic_gpu, triton or cudnn; page
      # size 0: contiguous; tiles as profile_decode.py's --tiles): throughput, memory
      # traffic, stalls (profile_decode.py).
      IFS=';' read -ra profiles <<< "${DECODE_PROFILES:-mosaic_gpu 64,4096,32,8,128,1;cudnn 64,4096,32,8,128,1}"
      for i in "${!profiles[@]}"; do
        read -r impl shape page tiles <<< "${profiles[$i]}"
        counters "$out/ncu_decode_$i.log" "${DECODE_KERNEL:-decode_attention|fmha|cudnn|sm90|flash}" \
          "decode $impl $shape${page:+ page $page}${tiles:+ tiles $tiles}" \
          $python benchmarks/profile_decode.py --impl "$impl" --shape "$shape" \
          ${page:+--page-size "$page"} ${tiles:+--tiles "$tiles"}
      done ;;
    ring-tests)
      # Context parallelism on every visible GPU (the nvidia-h200-x2 machine).
      timeout 300 $python -m pytest -m gpu -q -p no:cacheprovider -rfEs \
        tests/test_ring_attention.py 2>&1 | tee "$out/ring_tests.log" | tail -n 6 \
        | tee -a "$out/summary.log" ;;
    ring-bench)
      timeout 540 $python benchmarks/bench_ring_attention.py --out "$out" \
        ${RING_ONLY:+--only "$RING_ONLY"} ${RING_NAME:+--name "$RING_NAME"} 2>&1 | tee "$out/ring_bench.log" | tail -n 4 \
        | tee -a "$out/summary.log" ;;
    ring-profile)
      # The GPUs' clocks, power and throttle reasons every 20 ms beside it (the fields
      # without throttle reasons where this driver does not know them).
      query=timestamp,index,clocks.sm,power.draw,power.limit,temperature.gpu
      ( nvidia-smi --query-gpu=$query,clocks_event_reasons.active --format=csv -lms 20 \
          || nvidia-smi --query-gpu=$query --format=csv -lms 20 ) > "$out/ring_profile_gpus.csv" 2>&1 &
      smi=$!
      timeout 300 $python benchmarks/profile_ring_attention.py --out "$out" 2>&1 \
        | tee "$out/ring_profile.log" | tail -n 4 | tee -a "$out/summary.log"
      pkill -P $smi; kill $smi 2>/dev/null ;;
    ring-example)
      timeout 200 $python examples/long_context.py --tokens 65536 2>&1 \
        | tee "$out/ring_example.log" | tail -n 6 | tee -a "$out/summary.log" ;;
    accuracy-rows)
      timeout 200 $python benchmarks/accuracy_rows.py --out "$out" 2>&1 \
        | tee "$out/accuracy_rows_run.log" | tail -n 12 | tee -a "$out/summary.log" ;;
    command-buffers)
      timeout 300 $python benchmarks/command_buffers.py --out "$out" 2>&1 \
        | tee "$out/command_buffers_run.log" | tail -n 4 | tee -a "$out/summary.log" ;;
    example)
      timeout 120 $python examples/train_transformer.py --trace "$out/trace" 2>&1 \
        | tee "$out/example.log" | tail -n 8 | tee -a "$out/summary.log" ;;
  esac
  pack
done
