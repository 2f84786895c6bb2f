#!/usr/bin/env bash
# Fresh machine -> running model: installs dependencies, builds, generates with the embedded default tiny
# model and answers one OpenAI chat request from a live server.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-../shared/testdata/hf-tiny/glm5_next}  # GLM-5.3-Flash architecture, tiny random weights
scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target moesrv
echo "== moesrv generate --model $MODEL"
build/moesrv generate --model "$MODEL" --prompt-ids 1,17,256,42,7 --max-tokens 16
if build/moesrv serve --help >/dev/null 2>&1; then
  TOK=${TOKENIZER:-tests/fixtures/server/tiny_glm_tokenizer}
  PORT=${PORT:-18080}
  build/moesrv serve --model "$MODEL" --tokenizer "$TOK" --port "$PORT" --no-usage-stats >/tmp/moesrv-demo.log 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 50); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.2; done
  echo "== POST /v1/chat/completions"
  curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model":"default","messages":[{"role":"user","content":"Hello!"}],"max_tokens":16,"temperature":0}'
  echo
fi
