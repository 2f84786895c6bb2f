#!/usr/bin/env bash
# ThreadSanitizer run of the tests that exercise concurrency (continuous batching, the scheduler, the prefix cache
# under several requests). Not a CI stage (a separate full build); run it after touching serving/ or the server.
#   TSAN_BUILD_DIR (default build-tsan)  JOBS (default nproc)  TSAN_TESTS (default: the list below)
# Known report: one inside the uninstrumented cpp-httplib package (a buffer made on one connection worker and
# compared on another), most likely its function-local statics, which TSan cannot see guarded.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${TSAN_BUILD_DIR:-build-tsan}
TESTS=${TSAN_TESTS:-"test_forward_batch test_server_batch test_prefix_cache"}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
      -DCMAKE_CXX_FLAGS="-fsanitize=thread" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" -DMOESRV_CUDA=OFF >/dev/null
# shellcheck disable=SC2086
cmake --build "$BUILD_DIR" -j"${JOBS:-$(nproc)}" --target $TESTS
rc=0
for t in $TESTS; do
  echo "== $t"
  (cd "$BUILD_DIR" && TSAN_OPTIONS=${TSAN_OPTIONS:-"halt_on_error=0 second_deadlock_stack=1"} "./$t") || rc=1
done
exit $rc
