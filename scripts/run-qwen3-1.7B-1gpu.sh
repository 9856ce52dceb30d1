#!/usr/bin/env bash
# A first real run on ONE 80 GB GPU: GRPO on Qwen3-1.7B with speculative rollouts, trainer and
# engine colocated (slime's --colocate: the engine releases its weights and KV cache while the
# trainer steps; weights are pushed by CUDA IPC). Download the models and data yourself:
#   huggingface-cli download Qwen/Qwen3-1.7B --local-dir /root/Qwen3-1.7B
#   huggingface-cli download Qwen/Qwen3-0.6B --local-dir /root/Qwen3-0.6B      # the draft
#   huggingface-cli download --repo-type dataset zhuzilin/dapo-math-17k --local-dir /root/dapo-math-17k
#   bash scripts/run-qwen3-1.7B-1gpu.sh [extra scripts/train.py flags]         (--dry-run: check)
# Drafting: SPEC=STANDALONE (default; DRAFT= a small model sharing the tokenizer, Qwen3-0.6B) or
# SPEC=EAGLE3 with DRAFT= an EAGLE-3 draft for Qwen3-1.7B. Untested on GPUs so far: no GPU was
# available when it was written; the same flags run on CPU with a tiny model in the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/models/qwen3-1.7B.sh
OUT=${OUT:-runs/qwen3-1.7B-1gpu}

ROLLOUT_ARGS=(
   --prompt-data "${DATA:-/root/dapo-math-17k/dapo-math-17k.jsonl}" --input-key prompt --label-key label
   --apply-chat-template --rollout-shuffle --rm-type boxed_math
   --num-rollout 1000 --rollout-batch-size 16 --n-samples-per-prompt 8
   --rollout-max-response-len 4096 --rollout-temperature 1.0
)
GRPO_ARGS=(
   --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 --use-tis
)
OPTIMIZER_ARGS=(
   --lr 1e-6 --weight-decay 0.1 --micro-batch-size 4 --global-batch-size 128
)
SGLANG_ARGS=(
   --rollout-num-gpus 1
   --sglang-speculative-algorithm "${SPEC:-STANDALONE}"
   --sglang-speculative-draft-model-path "${DRAFT:-/root/Qwen3-0.6B}"
   --sglang-speculative-num-steps 3 --sglang-speculative-eagle-topk 1 --sglang-speculative-num-draft-tokens 4
   # The trainer loads first; the engine then takes this fraction of the GPU, less what the
   # trainer holds (its weights, master weights, grads and Adam state stay on the GPU).
   --sglang-mem-fraction-static 0.85
)
RUN_ARGS=(
   --colocate --actor-num-nodes 1 --actor-num-gpus-per-node 1 --weight-sync-mode tensor
   --output-dir "$OUT" --save "$OUT/ckpt" --load "$OUT/ckpt" --save-interval 100
   --save-hf "$OUT/hf-{rollout_id}"  # rerun the same command to resume after a crash
)
python -m scripts.train "${MODEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
