#!/usr/bin/env bash
# Layer rule for src/ (the table in CONTRIBUTING.md, "Layers"): an area may include its own headers and those of
# lower areas, never a higher one.
#
#   util(0) < format, tokenizer(1) < model(2) < backend(3) < runtime, serving(4) < server(5) < tools, bench(6) < cli(7) < src/main.cpp(8)
#
# Inside backend/, cpu/ never includes cuda/.
#
# Every `#include "area/..."` or `<area/...>` in src/ (.h .cpp .cu .cuh .inc) is mapped to the area's rank; an include
# whose rank is higher than the including file's is a violation. Areas of equal rank (format and tokenizer, runtime
# and serving, tools and bench) may include each other. Includes that do not start with a known area (same-folder
# "ops.h", system and third-party headers) are not checked; relative paths ("../x.h") are not resolved (none in src/
# today).
#
# Known violations live in scripts/layer_allowlist.txt, one `src/<file> -> <included path>` per line (# comments).
# The list may only shrink: the check fails on a violation that is not listed AND on a listed entry that no
# longer occurs (delete the line in the change that fixes the include).
#
# Usage: scripts/check_layers.sh [allow-list file]     (exit 0: clean, 1: violations or stale allow-list entries)
set -euo pipefail
cd "$(dirname "$0")/.."
allow=${1:-scripts/layer_allowlist.txt}

ranks="util=0 format=1 tokenizer=1 model=2 backend=3 runtime=4 serving=4 server=5 tools=6 bench=6 cli=7"  # src/main.cpp: 8 (top)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# found: "file -> include" per violation; where: the same with line numbers; unknown: areas without a rank.
grep -rnE --include='*.h' --include='*.cpp' --include='*.cu' --include='*.cuh' --include='*.inc' \
     '^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]' src \
  | awk -v ranks="$ranks" -v tmp="$tmp" '
      BEGIN { n = split(ranks, kv, " "); for (i = 1; i <= n; i++) { split(kv[i], p, "="); rank[p[1]] = p[2] } }
      {
        file = $0; sub(/:.*/, "", file)
        rest = substr($0, length(file) + 2); line = rest; sub(/:.*/, "", line)
        match(rest, /["<][^">]+[">]/); inc = substr(rest, RSTART + 1, RLENGTH - 2)
        rel = substr(file, 5)  # strip "src/"
        if (index(rel, "/")) {
          area = substr(rel, 1, index(rel, "/") - 1)
          if (!(area in rank)) { print area > (tmp "/unknown"); next }
          from = rank[area]
        } else { area = "main"; from = 8 }
        if (!index(inc, "/")) next
        to_area = substr(inc, 1, index(inc, "/") - 1)
        if (!(to_area in rank)) next
        if (rank[to_area] > from) {
          print file " -> " inc > (tmp "/found")
          printf "%s:%s: %s(%d) includes %s(%d): \"%s\"\n", file, line, area, from, to_area, rank[to_area], inc > (tmp "/where")
        }
      }'
touch "$tmp/found" "$tmp/where" "$tmp/listed"
status=0
if [[ -s $tmp/unknown ]]; then
  status=1
  for a in $(sort -u "$tmp/unknown"); do
    echo "check_layers: src/$a/ has no rank; give it one in ranks= (scripts/check_layers.sh) and in CONTRIBUTING.md" >&2
  done
fi
# Backends are siblings: the CPU backend never includes the CUDA one (CPU-only builds have no CUDA headers; shared
# pieces live in backend/ itself). Also caught: <backend/cuda/...> and relative paths ("../cuda/...").
cuda_inc='^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]((\.\./)*backend/cuda/|(\.\./)+cuda/)'
if cross=$(grep -rnE "$cuda_inc" src/backend/cpu); then
  status=1
  echo "check_layers: backend/cpu includes backend/cuda:" >&2
  sed 's/^/  /' <<<"$cross" >&2
fi
if [[ -f $allow ]]; then
  sed -E 's/#.*//; s/[[:space:]]+->[[:space:]]+/ -> /; s/^[[:space:]]+//; s/[[:space:]]+$//' "$allow" | grep -v '^$' \
    | LC_ALL=C sort -u >"$tmp/listed" || true
fi
found="$tmp/found"; listed="$tmp/listed"
LC_ALL=C sort -u -o "$found" "$found"

new=$(LC_ALL=C comm -23 "$found" "$listed")
stale=$(LC_ALL=C comm -13 "$found" "$listed")
if [[ -n $new ]]; then
  status=1
  echo "check_layers: upward includes (lower areas may not include higher ones):" >&2
  while IFS= read -r v; do
    grep -F "${v%% -> *}:" "$tmp/where" | grep -F "\"${v#* -> }\"" >&2
  done <<<"$new"
  echo "  Move the shared declaration down (or invert the dependency). The allow-list is for pre-existing" >&2
  echo "  violations only; do not add to $allow." >&2
fi
if [[ -n $stale ]]; then
  status=1
  echo "check_layers: $allow lists includes that no longer occur; delete these lines:" >&2
  sed 's/^/  /' <<<"$stale" >&2
fi
if ((status == 0)); then
  echo "check_layers: OK ($(grep -c . "$listed" || true) allow-listed upward includes left)"
fi
exit $status
