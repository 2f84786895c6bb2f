#!/usr/bin/env bash
# Fresh machine -> running model: installs dependencies, builds, generates with the embedded default tiny
# model and answers one OpenAI chat request from a live server. Every step must succeed: a failed build, a
# server that never becomes healthy or a chat request answered with an error (or without a choice) exits non-zero.
#   SKIP_SETUP=1: dependencies already installed (CI runs the demo after its setup and test stages).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-../shared/testdata/hf-tiny/glm5_next}  # GLM-5.3-Flash architecture, tiny random weights
[[ ${SKIP_SETUP:-0} == 1 ]] || scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target moesrv
echo "== moesrv generate --model $MODEL"
build/moesrv generate --model "$MODEL" --prompt-ids 1,17,256,42,7 --max-tokens 16
TOK=${TOKENIZER:-tests/fixtures/server/tiny_glm_tokenizer}
PORT=${PORT:-18080}
LOG=$(mktemp)
build/moesrv serve --model "$MODEL" --tokenizer "$TOK" --port "$PORT" --no-usage-stats >"$LOG" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$LOG"' EXIT
healthy=0
for _ in $(seq 100); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then healthy=1; break; fi
  kill -0 $pid 2>/dev/null || break
  sleep 0.2
done
if [[ $healthy != 1 ]]; then
  echo "demo: the server did not become healthy; its log:" >&2
  cat "$LOG" >&2
  exit 1
fi
# The id the server serves (GET /v1/models), as an OpenAI client configured for it would send.
MODEL_ID=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | grep -o '"id" *: *"[^"]*"' | head -1 | sed 's/.*"\([^"]*\)"$/\1/')
[[ -n $MODEL_ID ]] || { echo "demo: GET /v1/models named no model" >&2; exit 1; }
echo "== POST /v1/chat/completions (model $MODEL_ID)"
body=$(printf '{"model":"%s","messages":[{"role":"user","content":"Hello!"}],"max_tokens":16,"temperature":0}' \
  "$MODEL_ID")
if ! resp=$(curl -sS --fail-with-body "http://127.0.0.1:$PORT/v1/chat/completions" \
              -H 'Content-Type: application/json' -d "$body"); then
  echo "demo: the chat request failed: $resp" >&2
  exit 1
fi
echo "$resp"
if ! grep -q '"choices"' <<<"$resp" || grep -q '"error"' <<<"$resp"; then
  echo "demo: the chat answer has no choice" >&2
  exit 1
fi
echo "demo: OK"
