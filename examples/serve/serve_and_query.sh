#!/usr/bin/env bash
# Serve a model with spec_engine and query it the SGLang way (curl) and the OpenAI way (Python).
#   bash examples/serve/serve_and_query.sh [MODEL_DIR]
# Without MODEL_DIR a tiny random Llama + tokenizer is built (tiny.checkpoints). PORT=... picks
# the port (default: a free one). The server is stopped when the script exits, even on errors.
set -euo pipefail
MODEL=${1:+$(realpath "$1")}  # resolved before the cd below
cd "$(dirname "$0")/../.."  # the repo root, where examples/serve/openai_client.py is

WORK=$(mktemp -d)
if [ -z "$MODEL" ]; then
  MODEL=$WORK/tiny-llama
  python - "$MODEL" >/dev/null <<'PY'
import sys

from tiny.checkpoints import build_tiny_model

build_tiny_model(sys.argv[1])
PY
fi
# Binding port 0 makes the OS pick a free port; the server then takes it over.
free_port() {
  python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}
PORT=${PORT:-$(free_port)}
URL=http://127.0.0.1:$PORT

# Same flags as sglang.launch_server; the log goes to a file so the output below stays readable.
python -m spec_engine.launch_server --model-path "$MODEL" --port "$PORT" --random-seed 0 \
  --log-level warning >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
cleanup() {
  kill "$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# /health answers 200 once the model is loaded (and the warmup request has run).
for _ in $(seq 1 240); do
  if curl -sf "$URL/health" >/dev/null; then break; fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then cat "$WORK/server.log" >&2; exit 1; fi
  sleep 0.5
done
if ! curl -sf "$URL/health" >/dev/null; then
  echo "server did not come up" >&2
  cat "$WORK/server.log" >&2
  exit 1
fi
echo "server up at $URL"

# SGLang-native: text (or input_ids) + sampling_params in, {"text", "output_ids", "meta_info"} out.
echo "== POST /generate"
curl -sf "$URL/generate" -H 'content-type: application/json' \
  -d '{"text": "The cat", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}'
echo

# OpenAI-compatible chat: the prompt is built with the tokenizer's chat template.
echo "== POST /v1/chat/completions"
curl -sf "$URL/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
       "temperature": 0}'
echo

# The same server through the official openai client.
echo "== openai client"
python examples/serve/openai_client.py --base-url "$URL/v1"
