# Qwen3-8B. specrl reads the architecture from the checkpoint's config.json (no layer/head
# flags as in Megatron-LM); this file holds what depends on the model: where it is and how the
# trainer splits it (bf16 + TP 2: ~56 GB of weights, grads and Adam state per 80 GB GPU).
MODEL_ARGS=(
   --hf-checkpoint "${HF_CHECKPOINT:-/root/Qwen3-8B}"
   --tensor-model-parallel-size 2
   --bf16
)
