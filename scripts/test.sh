#!/usr/bin/env bash
# Layer check, then builds (CPU only, Release, warnings are errors) and runs the whole test suite.
#   BUILD_DIR (default build)  JOBS (default nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}  # build folders share ccache entries (relative paths)
scripts/check_layers.sh
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DMOESRV_WERROR=ON >/dev/null
cmake --build "$BUILD_DIR" -j"$JOBS"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$JOBS"
