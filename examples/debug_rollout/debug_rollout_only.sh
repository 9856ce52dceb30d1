#!/usr/bin/env bash
# Rollouts only (slime's --debug-rollout-only): engines generate and rewards are scored, but no
# trainer starts and no weights change; use it to check prompts, rewards and engine flags.
#   bash examples/debug_rollout/debug_rollout_only.sh [MODEL_DIR] [extra scripts/train.py flags...]
# Without MODEL_DIR a tiny random Llama + tokenizer is built (tiny.checkpoints). OUT=dir picks
# the output directory (default runs/debug-rollout): metrics.jsonl has one line per rollout
# (rollout/raw_reward, rollout/spec_accept_length, ...), rollouts/ the saved samples.
set -euo pipefail
MODEL=${1:+$(realpath "$1")}  # paths given are resolved before the cd below
OUT=${OUT:+$(realpath -m "$OUT")}
shift || true
cd "$(dirname "$0")/../.."  # the repo root: `python -m scripts.train` runs from there
OUT=${OUT:-runs/debug-rollout}  # by default under the repo root
mkdir -p "$OUT"
if [ -z "$MODEL" ]; then
  MODEL=$OUT/tiny-llama
  python - "$MODEL" >/dev/null <<'PY'
import sys

from tiny.checkpoints import build_tiny_model

build_tiny_model(sys.argv[1])
PY
fi

# Prompt data is JSONL; --input-key / --label-key name the fields. This is the tiny task
# (rollout/tiny_task.py): --rm-type tiny gives 1.0 when the response starts with the label letter.
cat >"$OUT/prompts.jsonl" <<'JSONL'
{"input": "copy: a", "label": "a"}
{"input": "copy: b", "label": "b"}
{"input": "copy: s", "label": "s"}
{"input": "copy: t", "label": "t"}
JSONL

# Engine flags pass through as --sglang-<flag>: here NGRAM speculation, which needs no draft model.
# --save-debug-rollout-data keeps every rollout; replay one into the trainer alone later with
# --load-debug-rollout-data "$OUT/rollouts/{rollout_id}.pt" (no engine starts then).
python -m scripts.train --debug-rollout-only \
  --hf-checkpoint "$MODEL" --output-dir "$OUT" --num-rollout 2 --ray-num-cpus 2 \
  --prompt-data "$OUT/prompts.jsonl" --input-key input --label-key label --rm-type tiny \
  --rollout-batch-size 2 --n-samples-per-prompt 4 --rollout-max-response-len 8 \
  --save-debug-rollout-data "$OUT/rollouts/{rollout_id}.pt" \
  --sglang-speculative-algorithm NGRAM --sglang-speculative-num-draft-tokens 4 \
  --sglang-max-total-tokens 2048 --sglang-max-running-requests 16 \
  "$@"
echo "metrics:"
cat "$OUT/metrics.jsonl"
