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
    # Values that are the only ones specrl runs are accepted silently.
    assert "--pipeline-model-parallel-size" not in notes and "--optimizer" not in notes


@pytest.mark.parametrize(
    "extra,needle",
    [
        ("--pipeline-model-parallel-size 2", "pipeline parallelism is not implemented"),
        ("--expert-model-parallel-size 8", "expert parallelism is not implemented"),
        ("--lr-decay-style cosine", "the learning rate is constant"),
        ("--attention-dropout 0.1", "specrl trains without dropout"),
        ("--finetune", "export them with --save-hf and pass that as --hf-checkpoint"),
        ("--use-rollout-logprobs", "recomputes the old policy's log-probs"),
        ("--partial-rollout", "aborted and dropped"),
        ("--num-epoch 3", "give --num-rollout"),
        ("--sglang-router-ip 10.0.0.1", "routed in-process"),
        ("--num-steps-per-rollout 3", "must be positive and divide the rollout's 32 samples"),
        ("--num-steps-per-rollout 2 --global-batch-size 8", "means --global-batch-size 16"),
    ],
)
def test_what_specrl_cannot_honour_is_refused_with_the_reason(extra, needle, tmp_path):
    with pytest.raises(SystemExit, match=needle):
        parse_args(argv("m", str(tmp_path), extra))


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
