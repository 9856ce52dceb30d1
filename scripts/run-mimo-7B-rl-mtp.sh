#!/usr/bin/env bash
# GRPO on MiMo-7B-RL with MTP speculative rollouts and the MTP layer trained online, one 8-GPU
# node: 4 GPUs train (TP 2 x DP 2), 4 GPUs run one engine each (slime's MiMo recipe:
# --enable-mtp-training --mtp-loss-scaling-factor 0.2, EAGLE with 3 steps, topk 1).
#   HF_CHECKPOINT=/root/MiMo-7B-RL DATA=/root/dapo-math-17k.jsonl bash scripts/run-mimo-7B-rl-mtp.sh [flags]
# Untested on GPUs so far (no GPU was available when it was written); the same flags run on CPU
# in tests/e2e/test_train_loop.py with a tiny MiMo-style model.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/models/mimo-7B-rl.sh

ROLLOUT_ARGS=(
   --prompt-data "${DATA:-/root/dapo-math-17k/dapo-math-17k.jsonl}" --input-key prompt --label-key label
   --apply-chat-template --rollout-shuffle --rm-type boxed_math
   --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
   --rollout-max-response-len 8192 --rollout-temperature 1.0
)
GRPO_ARGS=(
   --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 --use-tis
)
OPTIMIZER_ARGS=(
   --lr 1e-6 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
   --micro-batch-size 4 --global-batch-size 256
   --mtp-num-layers 1 --enable-mtp-training --mtp-loss-scaling-factor 0.2
)
SGLANG_ARGS=(
   --rollout-num-gpus 4 --rollout-num-gpus-per-engine 1
   --sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 3 --sglang-speculative-eagle-topk 1
   --sglang-speculative-num-draft-tokens 4 --sglang-mem-fraction-static 0.7
)
RUN_ARGS=(
   --actor-num-nodes 1 --actor-num-gpus-per-node 4 --weight-sync-mode distributed
   --output-dir "${OUT:-runs/mimo-7B-rl-mtp}" --save "${OUT:-runs/mimo-7B-rl-mtp}/ckpt" --load "${OUT:-runs/mimo-7B-rl-mtp}/ckpt" --save-interval 100
   --save-hf "${OUT:-runs/mimo-7B-rl-mtp}/hf-{rollout_id}"  # rerun the same command to resume after a crash
)
python -m scripts.train "${MODEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
