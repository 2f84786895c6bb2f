#!/usr/bin/env bash
# Fails when C++/CUDA lines changed since a base commit are not formatted as .clang-format says.
# Only changed lines are checked (git clang-format), so untouched code in a file is never flagged.
#
#   scripts/check_format.sh [base]     base: a commit/branch; default origin/main if it exists, else HEAD~1
#
# The diff is taken from the merge-base of <base> and HEAD to the working tree (committed and uncommitted
# changes alike). To fix what it reports:  git clang-format --binary clang-format-14 <base>
# (or apply the printed diff). Files: .h .cpp .cu .cuh (generated .inc tables are left alone).
set -euo pipefail
cd "$(dirname "$0")/.."
CF=${CLANG_FORMAT:-$(command -v clang-format-14 || command -v clang-format || true)}
EXT=h,cpp,cu,cuh
if [[ -z $CF ]] || ! command -v git-clang-format >/dev/null; then
  echo "check_format: clang-format / git-clang-format not found (Debian: apt-get install clang-format-14)" >&2
  exit 2
fi

if [[ $# -ge 1 ]]; then
  base=$1
elif git rev-parse -q --verify origin/main >/dev/null; then
  base=origin/main
else
  base=HEAD~1
fi
if ! git rev-parse -q --verify "$base^{commit}" >/dev/null; then
  # A shallow CI clone has no parent to compare with: say so rather than pass silently on a bogus base.
  echo "check_format: base '$base' does not exist (shallow clone?); fetch more history or pass a base" >&2
  exit 2
fi
mb=$(git merge-base "$base" HEAD 2>/dev/null || git rev-parse "$base")

set +e
out=$(git clang-format --binary "$CF" --extensions "$EXT" --diff "$mb" 2>&1)
rc=$?
set -e
# git-clang-format 14 exits 0 even when it prints a diff: the diff itself is the verdict.
if [[ $rc -ne 0 ]] && ! grep -q '^diff --git' <<<"$out"; then
  echo "$out" >&2; echo "check_format: git clang-format failed ($rc)" >&2; exit 2
fi
if grep -q '^diff --git' <<<"$out"; then
  echo "$out"
  echo >&2
  echo "check_format: the lines above (changed since $base, $(git rev-parse --short "$mb")) are not clang-formatted." >&2
  echo "  Fix: git clang-format --binary $(basename "$CF") --extensions $EXT $mb" >&2
  exit 1
fi
echo "check_format: OK (lines changed since $base, $(git rev-parse --short "$mb"), are formatted)"
