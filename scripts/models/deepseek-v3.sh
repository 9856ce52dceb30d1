# DeepSeek-V3 / R1 (DeepseekV3ForCausalLM: 671B total, 37B active): MLA attention (the engine
# caches the compressed latent), MoE with shared experts and grouped top-k, and one next-n MTP
# layer (model.layers.61), which the engine drafts with (--sglang-speculative-algorithm EAGLE
# without a draft path). Architecture from config.json, as for every model here. The trainer
# splits MoE models over data-parallel ranks only for now (tensor parallelism needs sequence
# parallelism for MoE layers in megatron, not wired yet).
MODEL_ARGS=(
   --hf-checkpoint "${HF_CHECKPOINT:-/root/DeepSeek-V3}"
   --tensor-model-parallel-size 1
   --bf16
)
