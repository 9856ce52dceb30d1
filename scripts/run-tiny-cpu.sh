#!/usr/bin/env bash
# The tiny CPU run: GRPO with MTP speculation (trained online) on a 2-core machine in minutes.
#   bash scripts/run-tiny-cpu.sh [extra scripts/train.py flags...]
#   OUT=dir chooses the output directory; MTP_TRAINING=0 keeps the MTP draft layer frozen.
#   SPEC=eagle3 drafts with an EAGLE-3 draft instead (random, trained online by
#   --enable-draft-training; DRAFT_TRAINING=0 keeps it frozen). SPEC=none decodes plainly. One
#   engine of two CPU ranks: RAY_NUM_CPUS=3 bash scripts/run-tiny-cpu.sh --rollout-num-gpus 2
#   --rollout-num-gpus-per-engine 2.
#   TASK=drift runs the drift task: from prompt DRIFT_AT (default 60, i.e. rollout 16) on, a
#   response must also stop repeating its first token, as the warm-up taught (the prompts are
#   read in order), so the policy's continuations change (docs/benchmarks/drift_mtp_cpu.md).
#   TASK=longtail runs the long-tailed task: each prompt asks for a response of its own length,
#   Pareto-distributed (median 6 tokens, one in twelve 32 or more, capped at 64; rollout.tiny_task),
#   so a rollout waits for its longest groups (docs/benchmarks/long_tail_cpu.md).
#   LOOP=train_async runs scripts/train_async.py instead of scripts/train.py (rollout N+1 generated
#   while the trainer trains on N).
#   MODEL=deepseek-v3 runs a tiny DeepSeek-V3-shaped model (DeepseekV3ForCausalLM) instead of the
#   MiMo-style one: MLA, a dense first layer then MoE (8 routed experts, top-2, one shared), and
#   one next-n MTP layer, which drafts (EAGLE). The warm-up leaves that layer random, so online
#   MTP training (megatron's MTP block) teaches it during the run and the accept length rises from
#   1; megatron's MoE balance loss (--moe-aux-loss-coeff 1e-4, as Megatron-LM's DeepSeek-R1
#   example) is logged per rollout (docs/benchmarks/rl_tiny_deepseek_cpu.md).
#   MODEL=glm4.5 runs a tiny GLM-4.5-shaped model (Glm4MoeForCausalLM: GQA with qkv bias, q/k
#   norms, partial rotary, the same MoE and a random next-n layer trained online) with the
#   routers' expert bias moved after every step (--moe-router-bias-update-rate 1e-3, DeepSeek-V3's
#   auxiliary-loss-free balancing) and pushed to the engine with the weights.
# Builds a tokenizer, a random model with one MTP layer (MODEL=mimo, the default: Qwen2 + a MiMo
# MTP layer), the tiny task and a supervised warm-up (scripts/prepare_tiny_run.py, once per $OUT),
# then runs scripts/train.py: a line per rollout and a closing summary on stdout, metrics in
# $OUT/metrics.jsonl, plots in $OUT/plots/.
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${TASK:-copy}
MODEL=${MODEL:-mimo}
case "$MODEL" in
  mimo) SUFFIX=; MODEL_FLAGS=(); PREPARE_FLAGS=() ;;
  deepseek-v3) SUFFIX=-deepseek-v3; MODEL_FLAGS=(--moe-aux-loss-coeff 1e-4); PREPARE_FLAGS=(--no-mtp-warmup) ;;
  glm4.5) SUFFIX=-glm4.5; MODEL_FLAGS=(--moe-router-bias-update-rate 1e-3); PREPARE_FLAGS=(--no-mtp-warmup) ;;
  *) echo "MODEL=$MODEL: use mimo (the default), deepseek-v3 or glm4.5" >&2; exit 2 ;;
esac
case "$TASK" in
  copy) OUT=${OUT:-runs/tiny-cpu$SUFFIX}; TASK_FLAGS=(--rollout-shuffle) ;;
  drift) OUT=${OUT:-runs/tiny-cpu-drift$SUFFIX}; TASK_FLAGS=(); PREPARE_FLAGS+=(--drift-at "${DRIFT_AT:-60}") ;;
  longtail)
    OUT=${OUT:-runs/tiny-cpu-longtail$SUFFIX}; PREPARE_FLAGS+=(--long-tail)
    TASK_FLAGS=(--rollout-shuffle --rollout-max-response-len 64
      --custom-generate-function-path rollout.tiny_task.long_tail_generate) ;;
  *) echo "TASK=$TASK: use copy (the default), drift or longtail" >&2; exit 2 ;;
esac
if [ ! -d "$OUT/assets/warm" ]; then
  python -m scripts.prepare_tiny_run --out "$OUT/assets" --steps 400 --model "$MODEL" "${PREPARE_FLAGS[@]}"
fi
if [ "$MODEL" != mimo ] && [ "${SPEC:-mtp}" != mtp ]; then
  echo "MODEL=$MODEL drafts with its own next-n layer: SPEC=mtp only" >&2; exit 2
fi
case "${SPEC:-mtp}" in
  none) SPEC_FLAGS=() ;;  # plain decoding
  mtp)
    SPEC_FLAGS=(--sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 2
      --sglang-speculative-eagle-topk 1)
    if [ "${MTP_TRAINING:-1}" != 0 ]; then SPEC_FLAGS+=(--enable-mtp-training); fi ;;
  eagle3)  # a random EAGLE-3 draft over the full vocabulary, trained online from scratch
    if [ ! -d "$OUT/assets/eagle3" ]; then
      python -c "import json, sys; from tiny.checkpoints import build_eagle_draft as b; \
w = sys.argv[1] + '/warm'; \
b(sys.argv[1] + '/eagle3', w, 3, draft_vocab_size=json.load(open(w + '/config.json'))['vocab_size'])" \
        "$OUT/assets"
    fi
    SPEC_FLAGS=(--sglang-speculative-algorithm EAGLE3 --sglang-speculative-draft-model-path "$OUT/assets/eagle3"
      --sglang-speculative-num-steps 2 --sglang-speculative-eagle-topk 1)
    if [ "${DRAFT_TRAINING:-1}" != 0 ]; then SPEC_FLAGS+=(--enable-draft-training); fi ;;
  *) echo "SPEC=${SPEC}: use mtp (the default), eagle3 or none" >&2; exit 2 ;;
esac
case "${LOOP:=train}" in
  train|train_async) ;;
  *) echo "LOOP=$LOOP: use train (the default) or train_async" >&2; exit 2 ;;
esac
python -m "scripts.$LOOP" \
  --hf-checkpoint "$OUT/assets/warm" --output-dir "$OUT" --num-rollout 30 \
  --prompt-data "$OUT/assets/task.jsonl" --input-key input --label-key label --rm-type tiny \
  --rollout-batch-size 4 --n-samples-per-prompt 8 --rollout-max-response-len 4 "${TASK_FLAGS[@]}" \
  --lr 2e-3 --micro-batch-size 32 --check-weight-update-equal --ray-num-cpus "${RAY_NUM_CPUS:-2}" \
  --sglang-max-total-tokens 8192 --sglang-max-running-requests 32 \
  "${MODEL_FLAGS[@]}" "${SPEC_FLAGS[@]}" "$@"
