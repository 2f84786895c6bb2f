#!/usr/bin/env bash
# CPU bench A/B: builds the bench target (bench/bench.cpp; tools/bench.cpp in older revisions) at REV in a git
# worktree (build dir kept between runs) and alternates it with this tree's build/bench, N rounds, on the same bench
# arguments; prints best-of-N prefill/decode tok/s per context and the ratio (after / before). Noisy hosts: raise N.
# Example (the model-core change, docs/perf.md):
#   scripts/bench_ab.sh 36975fa 5 --tiny --layers 4 --contexts 512,2048 --decode-tokens 64 --model-contexts 8192
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$1 n=$2
shift 2
wt=${BENCH_AB_WORKTREE:-../wt-bench-$rev}
[[ -d $wt ]] || git worktree add -f "$wt" "$rev" >/dev/null
cmake -S "$wt" -B "$wt/build" -DCMAKE_BUILD_TYPE=Release -DMOESRV_TESTS=OFF >/dev/null
cmake --build "$wt/build" -j2 --target bench >/dev/null
cmake --build build -j2 --target bench >/dev/null
out=$(mktemp -d)
for i in $(seq "$n"); do
  "$wt/build/bench" "$@" >"$out/before_$i.txt" 2>&1
  build/bench "$@" >"$out/after_$i.txt" 2>&1
done
# Measured table rows: | context | TTFT | prefill tok/s | decode tok/s | ...
best() { cat "$out"/$1_*.txt | awk -F'|' -v c="$2" -v col="$3" '$2+0 == c && NF > 8 && $3 ~ /[0-9]/ {v = $col + 0; if (v > m) m = v} END {print m}'; }
for ctx in $(grep -hE '^\| [0-9]+ \| [0-9.]+ \|' "$out/after_1.txt" | awk -F'|' '{print $2+0}' | sort -un); do
  for what in prefill:4 decode:5; do
    name=${what%%:*} col=${what##*:}
    b=$(best before "$ctx" "$col") a=$(best after "$ctx" "$col")
    awk -v n="$name" -v c="$ctx" -v b="$b" -v a="$a" 'BEGIN {printf "ctx %6d %-7s before %9.1f  after %9.1f  ratio %.3f\n", c, n, b, a, a / b}'
  done
done
rm -rf "$out"
