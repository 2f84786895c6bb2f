#!/usr/bin/env bash
# Compiles every target of the CUDA build (all .cu files for sm_86 and sm_90a, CUDA engine, tests, tools) with
# nvcc, no GPU needed, then runs the CUDA test binaries to check that they skip cleanly without a device.
#   CUDA_BUILD_DIR (default build-cuda-compile)  JOBS (default nproc)  NVCC (default /usr/local/cuda/bin/nvcc)
#   CUDA_ARCHS (default "86;90a": 90a for the wgmma kernels)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${CUDA_BUILD_DIR:-build-cuda-compile}
JOBS=${JOBS:-$(nproc)}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
CUDA_ARCHS=${CUDA_ARCHS:-86;90a}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
if [[ ! -x $NVCC ]]; then
  echo "ci_cuda_compile: nvcc not found at $NVCC (set NVCC=...)" >&2
  exit 2
fi
# Same build type and C++ flags as scripts/test.sh, so the host .cpp objects can come from ccache.
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DMOESRV_WERROR=ON -DMOESRV_CUDA=ON \
      -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS" >/dev/null
cmake --build "$BUILD_DIR" -j"$JOBS"

# Without a GPU the CUDA tests must skip (GTEST_SKIP), not fail or crash. With a GPU they simply run.
mapfile -t cuda_tests < <(ctest --test-dir "$BUILD_DIR" -N | sed -nE 's/^ *Test +#[0-9]+: (test_cuda[A-Za-z0-9_]*)$/\1/p')
if ((${#cuda_tests[@]} == 0)); then
  echo "ci_cuda_compile: no test_cuda* tests found" >&2
  exit 1
fi
regex="^($(IFS='|'; echo "${cuda_tests[*]}"))\$"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$JOBS" -R "$regex"
echo "ci_cuda_compile: OK (${#cuda_tests[@]} CUDA test binaries: ${cuda_tests[*]})"
