#!/usr/bin/env bash
# scripts/train.py with a custom generate function and a custom reward (rollouts only).
#   bash examples/custom_functions/run_custom_functions.sh [MODEL_DIR] [extra train.py flags...]
# Without MODEL_DIR a tiny random Llama + tokenizer is built (tiny.checkpoints). OUT=dir picks
# the output directory (default runs/custom-functions). Drop --debug-rollout-only to train.
set -euo pipefail
MODEL=${1:+$(realpath "$1")}  # paths given are resolved before the cd below
OUT=${OUT:+$(realpath -m "$OUT")}
shift || true
cd "$(dirname "$0")/../.."  # the repo root, so `examples.custom_functions....` is importable
OUT=${OUT:-runs/custom-functions}  # by default under the repo root
mkdir -p "$OUT"
if [ -z "$MODEL" ]; then
  MODEL=$OUT/tiny-llama
  python - "$MODEL" >/dev/null <<'PY'
import sys

from tiny.checkpoints import build_tiny_model

build_tiny_model(sys.argv[1])
PY
fi

cat >"$OUT/prompts.jsonl" <<'JSONL'
{"input": "copy: a", "label": "a"}
{"input": "copy: b", "label": "b"}
JSONL

# The functions are named by import path (module.function), as in slime.
python -m scripts.train --debug-rollout-only \
  --hf-checkpoint "$MODEL" --output-dir "$OUT" --num-rollout 1 --ray-num-cpus 2 \
  --prompt-data "$OUT/prompts.jsonl" --input-key input --label-key label \
  --custom-generate-function-path examples.custom_functions.generate.generate_with_tool \
  --custom-rm-path examples.custom_functions.reward.answer_reward \
  --rollout-batch-size 2 --n-samples-per-prompt 4 --rollout-max-response-len 8 \
  --save-debug-rollout-data "$OUT/rollouts/{rollout_id}.pt" \
  --sglang-max-total-tokens 2048 --sglang-max-running-requests 16 \
  "$@"
echo "metrics:"
cat "$OUT/metrics.jsonl"
