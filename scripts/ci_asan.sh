#!/usr/bin/env bash
# Builds the whole test suite with AddressSanitizer + UndefinedBehaviorSanitizer (MOESRV_SANITIZE=ON, -O1 -g1: line tables are enough for symbolized reports)
# into build-asan and runs it. Any ASan/UBSan/LeakSanitizer report fails the test that produced it.
#   ASAN_BUILD_DIR (default build-asan)  JOBS (default nproc)  CTEST_ARGS (extra ctest arguments, e.g. "-R tokenizer")
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${ASAN_BUILD_DIR:-build-asan}
JOBS=${JOBS:-$(nproc)}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
      -DMOESRV_SANITIZE=ON -DMOESRV_WERROR=ON -DMOESRV_CUDA=OFF >/dev/null
cmake --build "$BUILD_DIR" -j"$JOBS"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:abort_on_error=0:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1:strict_string_checks=1:print_summary=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:print_summary=1}
# shellcheck disable=SC2086
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$JOBS" ${CTEST_ARGS:-}
