# Qwen3-1.7B. specrl reads the architecture from the checkpoint's config.json; this file holds
# what depends on the model: where it is and how the trainer holds it (bf16, no tensor
# parallelism: ~31 GB of weights, fp32 master weights, grads and Adam state on one 80 GB GPU).
MODEL_ARGS=(
   --hf-checkpoint "${HF_CHECKPOINT:-/root/Qwen3-1.7B}"
   --tensor-model-parallel-size 1
   --bf16
)
