#!/usr/bin/env bash
# GRPO on Qwen3-8B with EAGLE-3 speculative rollouts, one 8-GPU node: 4 GPUs train (TP 2 x DP 2),
# 4 GPUs run one engine each. slime's layout: model args from scripts/models, then the groups.
#   HF_CHECKPOINT=/root/Qwen3-8B DRAFT=/root/Qwen3-8B-EAGLE3 DATA=/root/dapo-math-17k.jsonl \
#     bash scripts/run-qwen3-8B-eagle3.sh [extra scripts/train.py flags]     (--dry-run: check the flags)
# Untested on GPUs so far (no GPU was available when it was written); the same flags run on CPU
# in tests/e2e/test_train_loop.py with a tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/models/qwen3-8B.sh

ROLLOUT_ARGS=(
   --prompt-data "${DATA:-/root/dapo-math-17k/dapo-math-17k.jsonl}" --input-key prompt --label-key label
   --apply-chat-template --rollout-shuffle --rm-type boxed_math
   --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
   --rollout-max-response-len 8192 --rollout-temperature 1.0
   --over-sampling-batch-size 64 --dynamic-sampling-filter-path rollout.filters.check_reward_nonzero_std
)
GRPO_ARGS=(
   --advantage-estimator grpo --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28 --use-tis
)
OPTIMIZER_ARGS=(
   --lr 1e-6 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
   --micro-batch-size 4 --global-batch-size 256
)
SGLANG_ARGS=(
   --rollout-num-gpus 4 --rollout-num-gpus-per-engine 1
   --sglang-speculative-algorithm EAGLE3 --sglang-speculative-draft-model-path "${DRAFT:-/root/Qwen3-8B-EAGLE3}"
   --sglang-speculative-num-steps 3 --sglang-speculative-eagle-topk 1 --sglang-speculative-num-draft-tokens 4
   --sglang-mem-fraction-static 0.7
)
RUN_ARGS=(
   --actor-num-nodes 1 --actor-num-gpus-per-node 4 --weight-sync-mode distributed
   --output-dir "${OUT:-runs/qwen3-8B-eagle3}" --save "${OUT:-runs/qwen3-8B-eagle3}/ckpt" --load "${OUT:-runs/qwen3-8B-eagle3}/ckpt" --save-interval 100
   --save-hf "${OUT:-runs/qwen3-8B-eagle3}/hf-{rollout_id}"  # rerun the same command to resume after a crash
)
python -m scripts.train "${MODEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
