# MiMo-7B-RL: a Qwen2-style trunk with one MTP layer (model.mtp_layers.0.*), which the engine
# drafts with (--sglang-speculative-algorithm EAGLE without a draft path) and the trainer can
# train online (--enable-mtp-training). Architecture from config.json; split as for Qwen3-8B.
MODEL_ARGS=(
   --hf-checkpoint "${HF_CHECKPOINT:-/root/MiMo-7B-RL}"
   --tensor-model-parallel-size 2
   --bf16
)
