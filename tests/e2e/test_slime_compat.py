"""slime's run scripts parse unchanged: Megatron's model, parallelism, optimizer and logging flags
are logged no-ops or refused with a reason; a model-shape flag that contradicts --hf-checkpoint's
config is refused; --num-steps-per-rollout sets the global batch size as in slime."""

from __future__ import annotations

import shlex

import pytest

from specrl.train_options import check_checkpoints, parse_args

# slime's scripts/models/qwen3-4B.sh and the PERF_ARGS / MISC_ARGS / WANDB_ARGS of its run
# scripts, as users paste them.
QWEN3_4B_MODEL_ARGS = """
   --swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32
   --group-query-attention --num-query-groups 8 --use-rotary-position-embeddings
   --disable-bias-linear --normalization "RMSNorm" --norm-epsilon 1e-6 --rotary-base 1000000
   --vocab-size 151936 --kv-channels 128 --qk-layernorm
"""
PERF_MISC_ARGS = """
   --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
   --context-parallel-size 1 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1
   --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
   --use-dynamic-batch-size --max-tokens-per-gpu 9216 --optimizer adam --lr 1e-6
   --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
   --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32 --attention-backend flash --use-distributed-optimizer
   --megatron-to-hf-mode bridge --balance-data --use-slime-router
   --wandb-group qwen3-4B-test --disable-wandb-random-suffix
"""
BASE = "--hf-checkpoint {model} --prompt-data x.jsonl --rollout-batch-size 4 "
BASE += "--n-samples-per-prompt 8 --num-rollout 1 --output-dir {out}"


def argv(model: str, out: str, extra: str) -> list[str]:
    return shlex.split(BASE.format(model=model, out=out) + " " + extra)


def test_slime_run_script_flags_parse_and_say_what_they_do(tmp_path):
    args = parse_args(argv("m", str(tmp_path), QWEN3_4B_MODEL_ARGS + PERF_MISC_ARGS))
    assert args.options.trainer.tensor_model_parallel_size == 2
    notes = "\n".join(args.compat_notes)
    assert "--num-layers 36 has no effect in specrl: the model's shape comes from" in notes
    assert "--sequence-parallel has no effect in specrl: sequence parallelism is on" in notes
    assert "--recompute-granularity 'full' has no effect" in notes
    # a trainer option (whole experts per rank for MoE models: tests/trainer/test_moe_etp.py)
    assert args.options.trainer.expert_tensor_parallel_size == 1
    # slime's dynamic batch size (tests/trainer/test_packing.py, tests/trainer/test_moe_ep.py)
    trainer = args.options.trainer
    assert trainer.use_dynamic_batch_size and trainer.max_tokens_per_gpu == 9216
    assert trainer.log_probs_max_tokens_per_gpu == 9216
    assert trainer.balance_data
    # Values that are the only ones specrl runs are accepted silently.
    assert "--pipeline-model-parallel-size" not in notes and "--optimizer" not in notes


@pytest.mark.parametrize(
    "extra,needle",
    [
        ("--pipeline-model-parallel-size 2", "pipeline parallelism is not implemented"),
        ("--expert-model-parallel-size 0", "--expert-model-parallel-size must be positive"),
        ("--use-dynamic-batch-size", "needs --max-tokens-per-gpu"),
        ("--max-tokens-per-gpu 0", "--max-tokens-per-gpu must be positive"),
        (
            "--use-dynamic-batch-size --max-tokens-per-gpu 64 --expert-model-parallel-size 2",
            "different numbers of rows, which megatron's allgather dispatcher cannot exchange",
        ),
        ("--lr-decay-style cosine", "the learning rate is constant"),
        ("--attention-dropout 0.1", "specrl trains without dropout"),
        ("--finetune", "export them with --save-hf and pass that as --hf-checkpoint"),
        ("--custom-tis-function-path mis.py:compute_mis_weights_with_cp", "TIS is built in"),
        ("--use-rollout-logprobs --use-tis", "cannot be set at the same time"),
        ("--mask-offpolicy-in-partial-rollout", "it needs --partial-rollout"),
        ("--partial-rollout --use-rollout-routing-replay", "drop one of them"),
        ("--partial-rollout --buffer-filter-path m:f", "taken back oldest first"),
        ("--num-epoch 3", "give --num-rollout"),
        ("--sglang-router-ip 10.0.0.1", "routed in-process"),
        ("--num-steps-per-rollout 3", "must be positive and divide the rollout's 32 samples"),
        ("--num-steps-per-rollout 2 --global-batch-size 8", "means --global-batch-size 16"),
    ],
)
def test_what_specrl_cannot_honour_is_refused_with_the_reason(extra, needle, tmp_path):
    with pytest.raises(SystemExit, match=needle):
        parse_args(argv("m", str(tmp_path), extra))


def test_rollout_correction_flags_reach_the_loss(tmp_path):
    extra = "--use-rollout-logprobs --get-mismatch-metrics --tis-clip-low 0.5"
    loss = parse_args(argv("m", str(tmp_path), extra)).options.loss
    assert loss.use_rollout_logprobs and loss.get_mismatch_metrics and loss.tis_clip_low == 0.5


def test_partial_rollout_flags_reach_the_rollout(tmp_path):
    extra = "--partial-rollout --mask-offpolicy-in-partial-rollout"
    rollout = parse_args(argv("m", str(tmp_path), extra)).options.rollout
    assert rollout.partial_rollout and rollout.mask_offpolicy_in_partial_rollout


def test_num_steps_per_rollout_sets_the_global_batch_size(tmp_path):
    args = parse_args(argv("m", str(tmp_path), "--num-steps-per-rollout 4"))
    assert args.options.trainer.global_batch_size == 8  # 4 prompts x 8 samples / 4 steps


def test_model_shape_flags_are_checked_against_the_checkpoint(make_model, tmp_path):
    model = make_model("qwen3")
    from spec_engine.models.hf_config import ModelConfig

    config = ModelConfig.from_pretrained(model)
    same = f"--num-layers {config.num_hidden_layers} --hidden-size {config.hidden_size}"
    check_checkpoints(parse_args(argv(model, str(tmp_path), same + " --debug-rollout-only")))
    wrong = f"--num-layers {config.num_hidden_layers + 1}"
    with pytest.raises(SystemExit, match=f"--num-layers {config.num_hidden_layers + 1} contra"):
        check_checkpoints(parse_args(argv(model, str(tmp_path), wrong)))


# slime's scripts/models/deepseek-v3.sh (MOE_LAYER_FREQ as its loop prints it) and the MoE part
# of glm4.5-355B-A32B.sh, as users paste them.
DEEPSEEK_V3_MODEL_ARGS = """
   --disable-bias-linear --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432
   --num-attention-heads 128 --kv-channels 128 --normalization RMSNorm
   --position-embedding-type rope --norm-epsilon 1e-6 --swiglu
   --untie-embeddings-and-output-weights --vocab-size 129280 --multi-latent-attention
   --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
   --v-head-dim 128 --qk-layernorm --rotary-scaling-factor 40 --rotary-base 10000 --mscale 1.0
   --mscale-all-dim 1.0 --attention-softmax-in-fp32 --num-experts 256
   --moe-layer-freq [0,0,0,1,1] --moe-ffn-hidden-size 2048 --moe-router-topk 8
   --moe-shared-expert-intermediate-size 2048 --moe-router-pre-softmax
   --moe-router-score-function sigmoid --moe-router-enable-expert-bias
   --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall
   --moe-aux-loss-coeff 0 --moe-router-bias-update-rate 0 --moe-router-group-topk 4
   --moe-router-num-groups 8 --moe-grouped-gemm --moe-router-topk-scaling-factor 2.5
   --moe-router-dtype fp32 --moe-permute-fusion
"""
GLM45_MOE_ARGS = (
    "--moe-layer-freq [0]*3+[1]*89 --num-experts 160 --moe-router-bias-update-rate 1e-3"
)


def test_slime_moe_model_scripts_parse(tmp_path):
    args = parse_args(argv("m", str(tmp_path), DEEPSEEK_V3_MODEL_ARGS))
    notes = "\n".join(args.compat_notes)
    assert "--num-experts 256 has no effect in specrl: the model's shape comes from" in notes
    assert "--moe-grouped-gemm has no effect in specrl" in notes
    assert args.options.trainer.moe_router_bias_update_rate == 0.0
    args = parse_args(argv("m", str(tmp_path), GLM45_MOE_ARGS))
    assert args.options.trainer.moe_router_bias_update_rate == 1e-3
    with pytest.raises(SystemExit, match="score experts with a sigmoid"):
        parse_args(argv("m", str(tmp_path), "--moe-router-score-function softmax"))


def test_moe_and_mla_shape_flags_are_checked_against_the_checkpoint(make_model, tmp_path):
    from spec_engine.models.hf_config import ModelConfig

    model = make_model(arch="deepseek_v3")
    config = ModelConfig.from_pretrained(model)
    moe, mla = config.moe, config.mla
    dense = moe.first_k_dense_replace
    moe_layers = config.num_hidden_layers - dense
    same = (
        f"--multi-latent-attention --kv-channels {mla.v_head_dim} --v-head-dim {mla.v_head_dim} "
        f"--kv-lora-rank {mla.kv_lora_rank} --qk-pos-emb-head-dim {mla.qk_rope_head_dim} "
        f"--num-experts {moe.num_experts} --moe-router-topk {moe.top_k} "
        f"--moe-layer-freq [0]*{dense}+[1]*{moe_layers} --moe-ffn-hidden-size "
        f"{moe.intermediate_size} --moe-router-topk-scaling-factor {moe.routed_scaling_factor}"
    )
    check_checkpoints(parse_args(argv(model, str(tmp_path), same + " --debug-rollout-only")))
    for wrong, needle in [
        (f"--num-experts {moe.num_experts * 2}", f"--num-experts {moe.num_experts * 2} contra"),
        (f"--moe-layer-freq [1]*{config.num_hidden_layers}", "--moe-layer-freq"),
        ("--moe-layer-freq 'range(3)'", "neither an integer nor a list expression"),
        (f"--kv-channels {mla.v_head_dim + 1}", "--kv-channels"),
    ]:
        with pytest.raises(SystemExit, match=needle):
            check_checkpoints(parse_args(argv(model, str(tmp_path), wrong)))
    dense_model = make_model("qwen3")
    for flag in ("--multi-latent-attention", "--num-experts 8"):
        with pytest.raises(SystemExit, match="contradicts"):
            check_checkpoints(parse_args(argv(dense_model, str(tmp_path), flag)))
    with pytest.raises(SystemExit, match="--moe-router-bias-update-rate acts on MoE routers"):
        rate = "--moe-router-bias-update-rate 1e-3"
        check_checkpoints(parse_args(argv(dense_model, str(tmp_path), rate)))
