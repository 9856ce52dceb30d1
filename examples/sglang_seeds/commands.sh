# The launch commands on SGLang's speculative-decoding pages and slime's speculative-decoding page
# (the seeds this project started from), as a user pastes them: only the hub names are replaced
# by the local stand-ins that build_checkpoints.py writes under $CKPT, and `python3 -m
# sglang.launch_server` by `python -m spec_engine.launch_server`. Sourced by run.sh and by
# tests/server/test_cli_compat.py.
CKPT=${CKPT:-runs/sglang-seeds}

SEED_COMMANDS=(
  # EAGLE-2 (docs/advanced_features/speculative_decoding, both page versions)
  "--model $CKPT/Llama-2-7b-chat-hf --speculative-algorithm EAGLE --speculative-draft-model-path $CKPT/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 --cuda-graph-max-bs 8"
  "--model $CKPT/Llama-2-7b-chat-hf --speculative-algorithm EAGLE --speculative-draft-model-path $CKPT/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 --cuda-graph-max-bs 8 --log-level warning"
  # EAGLE-2 with torch.compile
  "--model $CKPT/Llama-2-7b-chat-hf --speculative-algorithm EAGLE --speculative-draft-model-path $CKPT/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 64 --mem-fraction 0.6 --enable-torch-compile --torch-compile-max-bs 2"
  "--model $CKPT/Llama-2-7b-chat-hf --speculative-algorithm EAGLE --speculative-draft-model-path $CKPT/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 64 --mem-fraction 0.6 --enable-torch-compile --torch-compile-max-bs 2 --log-level warning"
  # EAGLE-2 with FR-Spec
  "--model $CKPT/Meta-Llama-3-8B-Instruct --speculative-algorithm EAGLE --speculative-draft-model-path $CKPT/sglang-EAGLE-LLaMA3-Instruct-8B --speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 64 --speculative-token-map $CKPT/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt --mem-fraction 0.7 --cuda-graph-max-bs 2 --dtype float16"
  "--model $CKPT/Meta-Llama-3-8B-Instruct --speculative-algorithm EAGLE --speculative-draft-model-path $CKPT/sglang-EAGLE-LLaMA3-Instruct-8B --speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 64 --speculative-token-map $CKPT/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt --mem-fraction 0.7 --cuda-graph-max-bs 2 --dtype float16 --log-level warning"
  # EAGLE-3
  "--model $CKPT/Llama-3.1-8B-Instruct --speculative-algorithm EAGLE3 --speculative-draft-model-path $CKPT/sglang-EAGLE3-Llama-3.1-Instruct-8B --speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 32 --mem-fraction 0.6 --cuda-graph-max-bs 2 --dtype float16"
  "--model $CKPT/Llama-3.1-8B-Instruct --speculative-algorithm EAGLE3 --speculative-draft-model-path $CKPT/sglang-EAGLE3-Llama-3.1-Instruct-8B --speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 32 --mem-fraction 0.6 --cuda-graph-max-bs 2 --dtype float16 --log-level warning"
  # MTP (MiMo-7B-RL)
  "--model-path $CKPT/MiMo-7B-RL --host 0.0.0.0 --trust-remote-code --speculative-algorithm EAGLE --speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2 --mem-fraction 0.5 --log-level warning"
  # STANDALONE (a smaller LM as draft), and the same under SpecV2 (SGLANG_ENABLE_SPEC_V2=True)
  "--model $CKPT/Qwen2.5-7B-Instruct --speculative-algorithm STANDALONE --speculative-draft-model-path $CKPT/Qwen2.5-1.5B-Instruct --speculative-num-steps 4 --speculative-eagle-topk 2 --speculative-num-draft-tokens 7 --cuda-graph-max-bs 8 --mem-fraction-static 0.7 --log-level warning"
  "--model $CKPT/Qwen2.5-7B-Instruct --speculative-algorithm STANDALONE --speculative-draft-model-path $CKPT/Qwen2.5-1.5B-Instruct --speculative-num-steps 4 --speculative-eagle-topk 1 --speculative-num-draft-tokens 5 --cuda-graph-max-bs 8 --mem-fraction-static 0.7 --log-level warning"
  # NGRAM
  "--model $CKPT/Qwen2.5-7B-Instruct --speculative-algorithm NGRAM --speculative-num-draft-tokens 16 --speculative-ngram-max-match-window-size 12 --speculative-ngram-max-bfs-breadth 10 --cuda-graph-max-bs 8 --mem-fraction-static 0.8 --log-level warning"
)

# slime's page: SGLANG_ARGS for speculative decoding with the MTP layer, and its known-issue
# workarounds (scripts/train.py takes them as they are; run.sh slime checks them with --dry-run).
SLIME_SGLANG_ARGS=(
  --sglang-speculative-algorithm EAGLE
  --sglang-speculative-num-steps 3
  --sglang-speculative-eagle-topk 1
  --sglang-speculative-num-draft-tokens 4
  --debug-rollout-only
  --sglang-attention-backend fa3
  --sglang-cuda-graph-bs $(seq 1 32) $(seq 40 8 64) $(seq 80 16 160)
  --sglang-max-running-requests 128
  --sglang-disable-cuda-graph-padding
)
