# GLM-4.5 (Glm4MoeForCausalLM: 355B total, 32B active; GLM-4.5-Air: 106B/12B): MoE with a
# sigmoid router and expert bias, GQA with qkv bias and partial rotary, and one next-n MTP layer
# (model.layers.{num_hidden_layers}), which the engine drafts with (--sglang-speculative-algorithm
# EAGLE without a draft path). Architecture from config.json, as for every model here. The
# trainer splits MoE models over data-parallel ranks only for now (tensor parallelism needs
# sequence parallelism for MoE layers in megatron, not wired yet).
MODEL_ARGS=(
   --hf-checkpoint "${HF_CHECKPOINT:-/root/GLM-4.5-Air}"
   --tensor-model-parallel-size 1
   --bf16
)
