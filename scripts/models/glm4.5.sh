# GLM-4.5 (Glm4MoeForCausalLM: 355B total, 32B active; GLM-4.5-Air: 106B/12B): MoE with a
# sigmoid router and expert bias, GQA with qkv bias and partial rotary, and one next-n MTP layer
# (model.layers.{num_hidden_layers}), which the engine drafts with (--sglang-speculative-algorithm
# EAGLE without a draft path). Architecture from config.json, as for every model here.
# The trainer splits it over --tensor-model-parallel-size (sequence parallel for its MoE layers),
# --expert-model-parallel-size and --expert-tensor-parallel-size ranks as megatron does, and
# reads slime's torch_dist checkpoints of it as --ref-load (under Transformer Engine's names).
MODEL_ARGS=(
   --hf-checkpoint "${HF_CHECKPOINT:-/root/GLM-4.5-Air}"
   --tensor-model-parallel-size 1
   --bf16
)
