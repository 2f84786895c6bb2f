#!/usr/bin/env bash
# Reformats every tracked C++/CUDA source (src/ tests/ bench/ apps/) in place with .clang-format.
# Run it on a quiet tree (it touches most files), commit the result on its own, and add that commit to
# .git-blame-ignore-revs so `git blame` skips it.   Usage: scripts/format_all.sh [clang-format binary]
set -euo pipefail
cd "$(dirname "$0")/.."
CF=${1:-${CLANG_FORMAT:-$(command -v clang-format-14 || command -v clang-format)}}
git ls-files -z -- 'src/*.h' 'src/*.cpp' 'src/*.cu' 'src/*.cuh' 'tests/*.h' 'tests/*.cpp' 'apps/*.cpp' \
                   'bench/*.h' 'bench/*.cpp' 'bench/*.cu' 'bench/*.cuh' \
  | xargs -0 -r "$CF" -i --style=file
git diff --stat | tail -1
