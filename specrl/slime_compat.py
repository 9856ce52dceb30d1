"""slime and Megatron-LM launcher flags that scripts/train.py has no option for, so that slime's
run scripts (MODEL_ARGS, PERF_ARGS, MISC_ARGS...) parse unchanged: each is a logged no-op, or is
refused when given a value specrl cannot honour, naming why and what to use instead. None is an
"unrecognized argument".

Megatron's model-shape flags are no-ops because the trainer builds megatron's config from
--hf-checkpoint's config.json; `check_model_shape` still refuses one that contradicts it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class SlimeFlag:
    default: Any
    reason: str
    # Values accepted besides the default (as no-ops); None: every value is a logged no-op.
    allowed: Optional[tuple[Any, ...]] = None
    type: Any = str  # the value's type when `default` is None

    @property
    def value_type(self) -> Any:
        return self.type if self.default is None else type(self.default)


def _noop(default: Any, reason: str, type: Any = str) -> SlimeFlag:
    return SlimeFlag(default, reason, None, type)


def _only(default: Any, reason: str, *allowed: Any, type: Any = str) -> SlimeFlag:
    return SlimeFlag(default, reason, allowed, type)


_SHAPE = "the model's shape comes from --hf-checkpoint's config.json (checked against it)"
_FROM_CONFIG = "read from --hf-checkpoint's config.json"
_ROPE = "read from --hf-checkpoint's config.json (rope_scaling)"
_SIGMOID = "MoE routers score experts with a sigmoid, as the checkpoints specrl runs"
_NO_RECOMPUTE = "specrl's trainer does not recompute activations (no memory saving flag yet)"
_KERNELS = "specrl's trainer runs megatron-core's local layer spec; no kernel choice"
_NO_PP = "pipeline parallelism is not implemented; use --tensor-model-parallel-size and DP"
_WANDB = "wandb runs offline under --output-dir with --wandb-project; other wandb options unused"
_LOAD = (
    "--load resumes a run whole (policy, optimizer, RNG, data position); to start a new run from "
    "a checkpoint's weights, export them with --save-hf and pass that as --hf-checkpoint"
)

SLIME_FLAGS: dict[str, SlimeFlag] = {
    # Megatron model shape (slime's scripts/models/*.sh)
    "num_layers": _noop(None, _SHAPE, int),
    "hidden_size": _noop(None, _SHAPE, int),
    "ffn_hidden_size": _noop(None, _SHAPE, int),
    "num_attention_heads": _noop(None, _SHAPE, int),
    "num_query_groups": _noop(None, _SHAPE, int),
    "kv_channels": _noop(None, _SHAPE, int),
    "group_query_attention": _noop(False, _FROM_CONFIG),
    "vocab_size": _noop(None, _FROM_CONFIG, int),
    "make_vocab_size_divisible_by": _noop(None, _FROM_CONFIG, int),
    "max_position_embeddings": _noop(None, _FROM_CONFIG, int),
    "seq_length": _noop(None, _FROM_CONFIG + "; responses are bounded by rollout lengths", int),
    "position_embedding_type": _noop(None, _FROM_CONFIG),
    "use_rotary_position_embeddings": _noop(False, _FROM_CONFIG),
    "rotary_base": _noop(None, _FROM_CONFIG, float),
    "rotary_percent": _noop(None, _FROM_CONFIG, float),
    "normalization": _noop(None, _FROM_CONFIG),
    "norm_epsilon": _noop(None, _FROM_CONFIG, float),
    "swiglu": _noop(False, _FROM_CONFIG),
    "disable_bias_linear": _noop(False, _FROM_CONFIG),
    "add_qkv_bias": _noop(False, _FROM_CONFIG),
    "qk_layernorm": _noop(False, _FROM_CONFIG),
    "untie_embeddings_and_output_weights": _noop(False, _FROM_CONFIG),
    # Megatron MLA and MoE shape (slime's scripts/models/deepseek-v3.sh, glm4.5-355B-A32B.sh)
    "multi_latent_attention": _noop(False, _SHAPE),
    "q_lora_rank": _noop(None, _SHAPE, int),
    "kv_lora_rank": _noop(None, _SHAPE, int),
    "qk_head_dim": _noop(None, _SHAPE, int),
    "qk_pos_emb_head_dim": _noop(None, _SHAPE, int),
    "v_head_dim": _noop(None, _SHAPE, int),
    "rotary_scaling_factor": _noop(None, _ROPE, float),
    "mscale": _noop(None, _ROPE, float),
    "mscale_all_dim": _noop(None, _ROPE, float),
    "original_max_position_embeddings": _noop(None, _ROPE, int),
    "beta_fast": _noop(None, _ROPE, float),
    "beta_slow": _noop(None, _ROPE, float),
    "num_experts": _noop(None, _SHAPE, int),
    "moe_layer_freq": _noop(None, _SHAPE),
    "moe_ffn_hidden_size": _noop(None, _SHAPE, int),
    "moe_shared_expert_intermediate_size": _noop(None, _SHAPE, int),
    "moe_router_topk": _noop(None, _SHAPE, int),
    "moe_router_num_groups": _noop(None, _SHAPE, int),
    "moe_router_group_topk": _noop(None, _SHAPE, int),
    "moe_router_topk_scaling_factor": _noop(None, _SHAPE, float),
    "moe_router_score_function": _only(None, _SIGMOID, "sigmoid"),
    "moe_router_pre_softmax": _noop(False, _SIGMOID),
    "moe_router_enable_expert_bias": _noop(
        False,
        "MoE routers always select with the checkpoint's e_score_correction_bias; "
        "--moe-router-bias-update-rate moves it",
    ),
    "moe_router_dtype": _only(None, "routers compute in float32, as transformers", "fp32"),
    "moe_router_load_balancing_type": _only(
        None,
        "the balance loss is megatron's seq_aux_loss (DeepSeek-V3's), weighed by "
        "--moe-aux-loss-coeff (0: off)",
        "seq_aux_loss",
        "none",
    ),
    "moe_token_dispatcher_type": _noop(
        None, "the trainer dispatches tokens with megatron's allgather dispatcher"
    ),
    "moe_grouped_gemm": _noop(False, _KERNELS),
    "moe_permute_fusion": _noop(False, _KERNELS),
    # Megatron numerics and kernels
    "attention_dropout": _only(
        0.0, "specrl trains without dropout (RL needs the rollout's distribution); only 0"
    ),
    "hidden_dropout": _only(0.0, "specrl trains without dropout; only 0"),
    "accumulate_allreduce_grads_in_fp32": _noop(
        False, "gradients are always reduced in float32 (megatron's grad_reduce_in_fp32)"
    ),
    "attention_softmax_in_fp32": _noop(False, "attention softmax runs in float32 already"),
    "attention_backend": _noop(None, _KERNELS),
    "transformer_impl": _noop(None, _KERNELS),
    "recompute_granularity": _noop(None, _NO_RECOMPUTE),
    "recompute_method": _noop(None, _NO_RECOMPUTE),
    "recompute_num_layers": _noop(None, _NO_RECOMPUTE, int),
    "use_distributed_optimizer": _noop(
        False, "Adam's state is kept whole on every data-parallel rank (no ZeRO sharding)"
    ),
    "sequence_parallel": _noop(
        False,
        "sequence parallelism is on exactly where megatron needs it (MoE and MLA models at "
        "--tensor-model-parallel-size > 1, with specrl's sequence-parallel norms); dense models "
        "run tensor parallelism without it (same results, more activation memory)",
    ),
    "pipeline_model_parallel_size": _only(1, _NO_PP, 1, type=int),
    "context_parallel_size": _only(1, "context parallelism is not implemented", 1, type=int),
    # --expert-model-parallel-size is the trainer's own option (trainer_bridge.options)
    "megatron_to_hf_mode": _noop(None, "specrl converts with its own converter (bit-exact)"),
    # Optimizer and schedule
    "optimizer": _only("adam", "specrl's trainer runs Adam (megatron's optimizer)", "adam"),
    "lr_decay_style": _only("constant", "the learning rate is constant", "constant"),
    "lr_warmup_iters": _only(0, "the learning rate is constant (no warm-up)", 0, type=int),
    "min_lr": _noop(None, "the learning rate is constant (--lr)", float),
    "log_probs_chunk_size": _noop(None, "log-probs are computed per micro-batch", int),
    "loss_type": _only(
        "policy_loss", "specrl trains the policy loss only (no SFT loss)", "policy_loss"
    ),
    "custom_tis_function_path": _only(
        None,
        "TIS is built in (--use-tis, --tis-clip, --tis-clip-low: slime's vanilla TIS) and "
        "--get-mismatch-metrics logs the mismatch metrics of slime's mis.py (train/mis_*); "
        "no other TIS or rejection-sampling function is loaded",
    ),
    # Checkpoints
    "no_load_optim": _only(False, _LOAD),
    "no_load_rng": _only(False, _LOAD),
    "finetune": _only(False, _LOAD),
    "no_save_optim": _only(False, "a --save checkpoint always holds the optimizer (to resume)"),
    # Rollout and placement
    "num_epoch": _only(
        None, "give --num-rollout (prompts x epochs / --rollout-batch-size)", type=int
    ),
    "buffer_filter_path": _only(
        None,
        "the groups --partial-rollout keeps are taken back oldest first (slime's pop_first); no "
        "other buffer filter is loaded",
    ),
    "rollout_global_dataset": _noop(False, "the launcher always owns the prompt data"),
    "disable_rollout_global_dataset": _only(False, "the launcher always owns the prompt data"),
    "use_slime_router": _noop(False, "requests are routed in-process (rollout.router)"),
    "keep_old_actor": _only(False, "the trainer keeps no second copy of the policy"),
    "offload": _noop(
        False, "with --colocate engines release weights and KV around each train step"
    ),
    "offload_train": _noop(False, "the trainer stays on its device"),
    "offload_rollout": _noop(
        False, "with --colocate engines release weights and KV around each train step"
    ),
    "dump_details": _only(None, "use --save-debug-rollout-data for the rollouts"),
    # Logging
    "wandb_group": _noop(None, _WANDB),
    "wandb_team": _noop(None, _WANDB),
    "wandb_key": _noop(None, _WANDB),
    "wandb_host": _noop(None, _WANDB),
    "disable_wandb_random_suffix": _noop(False, _WANDB),
}

SlimeCompatArgs = dataclasses.make_dataclass(
    "SlimeCompatArgs",
    [
        (
            name,
            Optional[flag.value_type],
            dataclasses.field(
                default=flag.default,
                metadata={
                    "help": ("[no-op] " if flag.allowed is None else "[refused otherwise] ")
                    + flag.reason
                    + ".",
                    "unset": "none",  # slime's / Megatron-LM's None
                },
            ),
        )
        for name, flag in SLIME_FLAGS.items()
    ],
    frozen=True,
)
SlimeCompatArgs.__doc__ = "slime / Megatron-LM flags kept for drop-in run scripts."


def check_slime_options(args: argparse.Namespace) -> list[str]:
    """Refuse what cannot be honoured (SystemExit naming the flag, why, what to use); return one
    log line per accepted no-op that was given."""
    lines = []
    for name, flag in SLIME_FLAGS.items():
        value = getattr(args, name, flag.default)
        if value == flag.default:
            continue
        cli = f"--{name.replace('_', '-')}"
        given = cli if value is True else f"{cli} {value!r}"
        if flag.allowed is not None and value not in flag.allowed:
            raise SystemExit(f"error: {given} is not supported: {flag.reason}")
        if flag.allowed is None:
            lines.append(f"{given} has no effect in specrl: {flag.reason}")
    return lines


# Shape flags that only an MLA or MoE model may carry.
_MOE_MLA_SHAPE = {
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "num_experts",
    "moe_layer_freq",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_router_topk",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
}


def check_model_shape(args: argparse.Namespace, config: Any) -> None:
    """Megatron's shape flags, when given, must match --hf-checkpoint's config (a ModelConfig)."""
    shape: dict[str, Any] = {
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "multi_latent_attention": config.mla is not None,
    }
    mla, moe = config.mla, config.moe
    if mla is None:
        shape.update(num_query_groups=config.num_key_value_heads, kv_channels=config.head_dim)
    else:  # megatron's MLA reads kv_channels as the value head size; query groups are unused
        shape.update(
            kv_channels=mla.v_head_dim,
            q_lora_rank=mla.q_lora_rank,
            kv_lora_rank=mla.kv_lora_rank,
            qk_head_dim=mla.qk_nope_head_dim,
            qk_pos_emb_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim,
        )
    if moe is not None:
        shape.update(
            num_experts=moe.num_experts,
            moe_layer_freq=[int(moe.is_moe_layer(i)) for i in range(config.num_hidden_layers)],
            moe_ffn_hidden_size=moe.intermediate_size,
            moe_shared_expert_intermediate_size=moe.num_shared_experts * moe.intermediate_size,
            moe_router_topk=moe.top_k,
            moe_router_num_groups=moe.n_group,
            moe_router_group_topk=moe.topk_group,
            moe_router_topk_scaling_factor=moe.routed_scaling_factor,
        )
    for name in SLIME_FLAGS:
        given = getattr(args, name, None)
        if given is None or given is False or name not in shape and name not in _MOE_MLA_SHAPE:
            continue
        want = shape.get(name)
        if name == "moe_layer_freq" and want is not None:
            given = _layer_pattern(given, config.num_hidden_layers)
        if given != want:
            have = "no such layers" if want is None else want
            raise SystemExit(
                f"error: --{name.replace('_', '-')} {getattr(args, name)} contradicts "
                f"{args.hf_checkpoint} ({have}); specrl takes the model's shape from its "
                "config.json: drop the flag or point --hf-checkpoint at the model it describes"
            )


def _layer_pattern(text: str, num_layers: int) -> list[int]:
    """Megatron's --moe-layer-freq: an int N (every N-th layer is MoE, from layer 0) or a Python
    list expression such as "[0]*3+[1]*58" (1: MoE), parsed without eval."""
    try:
        every = int(text)
    except ValueError:
        pass
    else:
        return [int(i % every == 0) for i in range(num_layers)]

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(ast.dump(node))

    try:
        pattern = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise SystemExit(
            f"error: --moe-layer-freq {text!r} is neither an integer nor a list expression such "
            'as "[0]*3+[1]*58"'
        ) from None
    return pattern
