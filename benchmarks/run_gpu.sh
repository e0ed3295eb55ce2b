#!/usr/bin/env bash
# The one command for the GPU machine: GPU-marked tests, then the benchmarks, with every
# log and result under $OUT (default benchmarks/results/run). Run from the repo root:
#
#   STAGES="tests tune bench" bash benchmarks/run_gpu.sh
#
# Stages: tests (pytest -m gpu), tune (tune_rows.py), bench (bench_softmax.py and
# bench_cross_entropy.py). Each is bounded by a timeout so that one hung stage still
# leaves the others' results. Everything is also packed into $OUT/run.tgz, since only a
# few files come back from the machine.
set -uo pipefail
out=${OUT:-benchmarks/results/run}
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONPATH=$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  $python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$out/env.log"

pack() { tar -czf "$out/run.tgz" -C "$out" --exclude run.tgz . ; }

for stage in ${STAGES:-tests tune bench}; do
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
      timeout 300 $python benchmarks/bench_softmax.py --out "$out" 2>&1 | tee "$out/bench.log"
      timeout 120 $python benchmarks/bench_cross_entropy.py --out "$out" 2>&1 \
        | tee -a "$out/bench.log"
      tail -n 2 "$out/bench.log" | tee -a "$out/summary.log" ;;
    *) echo "unknown stage $stage" | tee -a "$out/summary.log" ;;
  esac
  pack
done
