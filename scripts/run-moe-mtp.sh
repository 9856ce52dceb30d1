#!/usr/bin/env bash
# GRPO on an MoE model with native MTP layers, the MTP layer drafting the rollouts (EAGLE, 3 steps,
# topk 1, as slime's GLM-4.5 and DeepSeek-R1 recipes run SGLang):
#   MODEL=glm4.5|deepseek-v3 HF_CHECKPOINT=/root/GLM-4.5-Air DATA=/root/dapo-math-17k.jsonl \
#     bash scripts/run-moe-mtp.sh [flags]
# MODEL picks scripts/models/$MODEL.sh; --dry-run checks every flag and the checkpoint. The
# trainer builds both families on megatron (MoE, MLA, next-n layers) without tensor parallelism,
# and an engine runs on one GPU (engine tensor parallelism does not exist yet): the full
# GLM-4.5 / DeepSeek-V3 checkpoints fit neither, smaller checkpoints of the same families do.
# Untested on GPUs (no GPU has run it).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-glm4.5}
if [ ! -f "scripts/models/$MODEL.sh" ]; then
   echo "MODEL=$MODEL: no scripts/models/$MODEL.sh; use glm4.5 or deepseek-v3" >&2
   exit 2
fi
source "scripts/models/$MODEL.sh"

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
   --micro-batch-size 1 --global-batch-size 256
)
SGLANG_ARGS=(
   --rollout-num-gpus 8 --rollout-num-gpus-per-engine 1
   --sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 3 --sglang-speculative-eagle-topk 1
   --sglang-speculative-num-draft-tokens 4 --sglang-mem-fraction-static 0.7
   --sglang-enable-return-routed-experts  # routing replay (slime's R3) needs the rollout's experts
)
RUN_ARGS=(
   --actor-num-nodes 1 --actor-num-gpus-per-node 8 --weight-sync-mode distributed
   --output-dir "${OUT:-runs/$MODEL-mtp}" --save "${OUT:-runs/$MODEL-mtp}/ckpt" --load "${OUT:-runs/$MODEL-mtp}/ckpt" --save-interval 100
)
python -m scripts.train "${MODEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
