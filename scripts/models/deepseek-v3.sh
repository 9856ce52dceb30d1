# DeepSeek-V3 / R1 (DeepseekV3ForCausalLM: 671B total, 37B active): MLA attention (the engine
# caches the compressed latent), MoE with shared experts and grouped top-k, and one next-n MTP
# layer (model.layers.61), which the engine drafts with (--sglang-speculative-algorithm EAGLE
# without a draft path). Architecture from config.json, as for every model here.
# The trainer splits it over --tensor-model-parallel-size (sequence parallel for its MoE layers),
# --expert-model-parallel-size and --expert-tensor-parallel-size ranks as megatron does, and
# reads slime's torch_dist checkpoints of it as --ref-load (under Transformer Engine's names).
MODEL_ARGS=(
   --hf-checkpoint "${HF_CHECKPOINT:-/root/DeepSeek-V3}"
   --tensor-model-parallel-size 1
   --bf16
)
