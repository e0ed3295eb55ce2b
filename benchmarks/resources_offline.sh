#!/usr/bin/env bash
# ptxas' registers and spills of the Hopper attention kernels without a GPU
# (resources_offline.py says how); arguments go to it:
#
#   bash benchmarks/resources_offline.sh 4,4096,16,16,128,1 4,4096,32,8,128,1 --schedule fresh
#   bash benchmarks/resources_offline.sh --pipelining --feature mask 1,1024,2,2,128,0
#
# --pipelining runs pipelining_offline.py instead: which loads Triton pipelines in the
# Triton attention kernels. The first run sets up $RESOURCES_DIR (default
# /tmp/jaxsoftmax-resources, about 1.5 GB): a Python 3.12 venv with the GPU machine's JAX
# (0.11.2) and its CUDA 13 plugin, ptxas (nvidia-cuda-nvcc) and triton, all from the
# package registry, and a stand-in libcuda built with cc that reports one device of
# compute capability 9.0 and refuses to load a binary.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${RESOURCES_DIR:-/tmp/jaxsoftmax-resources}
jax_version=0.11.2
if [ ! -x "$dir/venv/bin/python" ]; then
  mkdir -p "$dir"
  PYENV_VERSION=3.12.1 python3.12 -m venv "$dir/venv"
  "$dir/venv/bin/pip" install -q "jax==$jax_version" "jaxlib==$jax_version" \
    "jax-cuda13-plugin==$jax_version" "jax-cuda13-pjrt==$jax_version" nvidia-cuda-nvcc
fi
if [ ! -d "$dir/venv/lib/python3.12/site-packages/triton" ]; then
  "$dir/venv/bin/pip" install -q triton
fi
if [ ! -f "$dir/libcuda.so.1" ]; then
  cat > "$dir/libcuda.c" <<'C'
/* The driver calls MosaicGpuCompile makes: one device of compute capability 9.0, and a
   module load that fails (there is nothing to load it on). */
typedef int CUresult;
CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDeviceGet(int *device, int ordinal) { *device = 0; return 0; }
CUresult cuCtxGetDevice(int *device) { *device = 0; return 0; }
CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
  *value = attribute == 75 ? 9 : 0;  /* 75, 76: compute capability major, minor */
  return 0;
}
CUresult cuGetErrorString(CUresult error, const char **text) {
  *text = "no device (resources_offline's stand-in libcuda)";
  return 0;
}
CUresult cuGetErrorName(CUresult error, const char **text) {
  *text = "CUDA_ERROR_NO_DEVICE";
  return 0;
}
CUresult cuModuleLoadData(void **module, const void *image) { return 100; }
C
  cc -shared -fPIC -o "$dir/libcuda.so.1" "$dir/libcuda.c"
fi
nvidia=$("$dir/venv/bin/python" -c "import nvidia.cu13; print(nvidia.cu13.__path__[0])")
log="$dir/last_run.log"
status=0
script=benchmarks/resources_offline.py report=" registers, spills |  loop: "
if [ "${1:-}" = --pipelining ]; then
  shift
  script=benchmarks/pipelining_offline.py report=" cp.async "
fi
# ptxas from the CUDA wheel; nvdisasm (for --loops) from triton's.
tools="$nvidia/bin:$dir/venv/lib/python3.12/site-packages/triton/backends/nvidia/bin"
LD_LIBRARY_PATH="$dir" PATH="$tools:$PATH" MOSAIC_GPU_CUDA_ROOT="$nvidia" \
  JAX_PLATFORMS=cpu PYTHONPATH=".:benchmarks" \
  "$dir/venv/bin/python" "$script" "$@" > "$log" 2>&1 || status=$?
grep -E "$report" "$log" || true
if [ $status -ne 0 ]; then
  tail -n 20 "$log" >&2
fi
exit $status
