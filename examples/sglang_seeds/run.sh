#!/usr/bin/env bash
# Run one of SGLang's seed launch commands against tiny local stand-ins, query POST /generate,
# stop the server:   bash examples/sglang_seeds/run.sh N      (N = 0..11; `list` prints them)
# or check slime's --sglang-* lines with scripts/train.py --dry-run:
#                    bash examples/sglang_seeds/run.sh slime
set -euo pipefail
cd "$(dirname "$0")/../.."
export CKPT=${CKPT:-runs/sglang-seeds}
source examples/sglang_seeds/commands.sh
[ -d "$CKPT/MiMo-7B-RL" ] || python examples/sglang_seeds/build_checkpoints.py "$CKPT" >/dev/null
case "${1:-0}" in
  list)
    for i in "${!SEED_COMMANDS[@]}"; do echo "$i: ${SEED_COMMANDS[$i]}"; done ;;
  slime)
    python -m scripts.train --hf-checkpoint "$CKPT/MiMo-7B-RL" --prompt-data "$CKPT/task.jsonl" \
      --input-key input --label-key label --rm-type tiny --rollout-batch-size 2 --num-rollout 1 \
      --output-dir "$CKPT/slime-run" "${SLIME_SGLANG_ARGS[@]}" --dry-run ;;
  *)
    PORT=${PORT:-30000}
    # shellcheck disable=SC2086  # the command is a string of flags, split as a shell would
    python -m spec_engine.launch_server ${SEED_COMMANDS[$1]} --port "$PORT" &
    SERVER=$!
    trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
    for _ in $(seq 120); do
      curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
      kill -0 $SERVER 2>/dev/null || exit 1
      sleep 0.5
    done
    curl -sf "http://127.0.0.1:$PORT/generate" -H 'Content-Type: application/json' \
      -d '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}'
    echo ;;
esac
