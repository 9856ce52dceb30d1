"""TrainerArgs: the trainer's options (slime / Megatron-LM names), validated on construction."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

QKV_FORMATS = ("thd", "bshd")


@dataclass
class TrainerArgs:
    """Trainer options; names follow slime / Megatron-LM."""

    hf_checkpoint: Optional[str] = field(
        default=None,
        metadata={"help": "Hugging Face checkpoint the policy starts from (and the engines load)."},
    )
    lr: float = field(default=1e-6, metadata={"help": "Adam learning rate (constant)."})
    weight_decay: float = field(default=0.0, metadata={"help": "Adam weight decay."})
    adam_beta1: float = field(default=0.9, metadata={"help": "Adam beta1."})
    adam_beta2: float = field(default=0.98, metadata={"help": "Adam beta2."})
    clip_grad: float = field(
        default=1.0, metadata={"help": "Gradient clipping by global norm (0 disables)."}
    )
    micro_batch_size: int = field(
        default=4,
        metadata={"help": "Sequences per forward/backward (not with --use-dynamic-batch-size)."},
    )
    global_batch_size: Optional[int] = field(
        default=None,
        metadata={"help": "Sequences per optimizer step (default: a whole rollout in one step)."},
    )
    use_dynamic_batch_size: bool = field(
        default=False,
        metadata={
            "help": "slime's dynamic batch size: a micro batch holds as many sequences as fit "
            "--max-tokens-per-gpu (first fit in order; a longer sequence runs alone), not "
            "--micro-batch-size. Tokens are a sequence's prompt and response; padded (--qkv-format "
            "bshd) a micro batch counts its rows times its longest row."
        },
    )
    max_tokens_per_gpu: Optional[int] = field(
        default=None,
        metadata={
            "help": "Token budget of a train micro batch (--use-dynamic-batch-size).",
            "unset": "none; --use-dynamic-batch-size needs it",
        },
    )
    log_probs_max_tokens_per_gpu: Optional[int] = field(
        default=None,
        metadata={
            "help": "Token budget of a log-prob (no-grad) micro batch with "
            "--use-dynamic-batch-size (default: --max-tokens-per-gpu); larger is faster."
        },
    )
    balance_data: bool = field(
        default=False,
        metadata={
            "help": "slime's: each data-parallel rank trains as many sequences, chosen so the "
            "ranks' token counts are close (Karmarkar-Karp), not a contiguous run of the rollout."
        },
    )
    qkv_format: str = field(
        default="bshd",
        metadata={
            "choices": QKV_FORMATS,
            "help": "Micro-batch layout (slime's flag): thd packs a micro batch's sequences "
            "into one row (cu_seqlens, megatron's PackedSeqParams), so no padding token is "
            "computed; bshd right-pads them to the longest. Default bshd (slime's is thd). Not "
            "with --enable-draft-training.",
        },
    )
    tensor_model_parallel_size: int = field(
        default=1, metadata={"help": "Megatron tensor parallel size."}
    )
    expert_model_parallel_size: int = field(
        default=1,
        metadata={
            "help": "MoE models: megatron's expert parallel size; each rank of an expert group "
            "holds num_experts / this many routed experts (megatron's allgather dispatcher sends "
            "tokens to them). Taken from the data-parallel ranks: the trainer ranks must be a "
            "multiple of --tensor-model-parallel-size x this (with "
            "--expert-tensor-parallel-size 1: of each), and it must divide the experts."
        },
    )
    expert_tensor_parallel_size: Optional[int] = field(
        default=None,
        metadata={
            "help": "MoE models: megatron's expert tensor parallel size, --tensor-model-parallel-"
            "size (each routed expert split over the TP ranks like a dense MLP) or "
            "1 (slime's MoE recipes: every rank holds whole experts and runs them on its own "
            "tokens; the expert-parallel group is then carved out of TP x DP, so "
            "--expert-model-parallel-size may span the TP ranks), or a divisor of TP in between "
            "(each expert split over that many ranks, TP rank r holding slice r mod it). Sizes "
            "that do not divide TP are refused.",
            "unset": "--tensor-model-parallel-size",
        },
    )
    seed: int = field(
        default=1234,
        metadata={
            "help": "Seed of the trainer (megatron's RNG) and, in scripts/train.py, of the "
            "engines' sampling."
        },
    )
    bf16: bool = field(
        default=False,
        metadata={
            "help": "bfloat16 parameters and activations with float32 master weights in the "
            "optimizer (Megatron's mixed precision)."
        },
    )
    enable_mtp_training: bool = field(
        default=False,
        metadata={
            "help": "Train the MTP layers online with the policy (their own loss; the trunk gets "
            "no gradient from it)."
        },
    )
    mtp_num_layers: Optional[int] = field(
        default=None,
        metadata={
            "help": "MTP layers of the model (slime's / Megatron's flag). specrl builds the ones "
            "the checkpoint has (num_nextn_predict_layers); a different count is refused.",
            "unset": "the checkpoint's",
        },
    )
    mtp_loss_scaling_factor: float = field(
        default=0.2, metadata={"help": "Weight of the MTP loss."}
    )
    enable_draft_training: bool = field(
        default=False,
        metadata={
            "help": "Train the engines' external draft (--sglang-speculative-draft-model-path) "
            "online on the policy's hidden states and logits in each train step, with its own "
            "Adam at --draft-lr; its weights are pushed with the policy's. EAGLE-3 "
            "(--sglang-speculative-algorithm EAGLE3): SpecForge's training-time-test loss; "
            "EAGLE-2 (EAGLE with a LlamaForCausalLMEagle draft): EAGLE's feature regression + "
            "0.1 x cross-entropy through the policy's head; STANDALONE (a small LM as draft): "
            "distillation, KL(policy || draft) at response positions. One trainer rank; not "
            "with --bf16 yet."
        },
    )
    draft_checkpoint: Optional[str] = field(
        default=None,
        metadata={
            "cli": False,
            "help": "The draft --enable-draft-training trains (the launcher passes the engines' "
            "--sglang-speculative-draft-model-path).",
        },
    )
    speculative_algorithm: Optional[str] = field(
        default=None,
        metadata={
            "cli": False,
            "help": "The engines' --sglang-speculative-algorithm (the launcher passes it): which "
            "draft --enable-draft-training trains (STANDALONE: a plain LM, distilled). Default: "
            "the draft checkpoint's architecture decides.",
        },
    )
    draft_lr: Optional[float] = field(
        default=None,
        metadata={
            "help": "Learning rate of the draft trained online (the MTP layers with "
            "--enable-mtp-training, the external draft with --enable-draft-training): a draft may "
            "need to move faster than the policy to keep up with it. Not with --bf16.",
            "unset": "--lr",
        },
    )
    moe_aux_loss_coeff: float = field(
        default=0.0,
        metadata={
            "help": "MoE models: weight of megatron's sequence-level load-balancing loss "
            "(DeepSeek-V3's seq_aux_loss), added to every train step's loss; its value (over the "
            "coefficient, averaged over MoE layers and micro batches as megatron logs it) is "
            "logged per rollout as train/moe_seq_load_balancing_loss. 0 (slime's MoE recipes' "
            "setting): not computed."
        },
    )
    moe_router_bias_update_rate: float = field(
        default=0.0,
        metadata={
            "help": "MoE models: DeepSeek-V3's auxiliary-loss-free balancing (Megatron-LM's "
            "flag): after every optimizer step each router's expert bias (the checkpoint's "
            "e_score_correction_bias) moves by this rate towards balance, up for experts that got "
            "fewer than the mean of the step's real (non-padding) tokens, down for those that got "
            "more; the engines route with the moved bias from the next weight update on, and "
            "checkpoints keep it. 0 (slime's MoE recipes' setting; Megatron-LM's default is "
            "1e-3): the bias stays the checkpoint's."
        },
    )
    use_rollout_routing_replay: bool = field(
        default=False,
        metadata={
            "help": "slime's R3 (arxiv 2510.11370), MoE models: the engines report each token's "
            "routed experts (--sglang-enable-return-routed-experts, set by this flag) and every "
            "trainer forward (log-probs, train steps, the KL reference) routes each token to "
            "them."
        },
    )
    use_routing_replay: bool = field(
        default=False,
        metadata={
            "help": "slime's R2 (arxiv 2507.18071): implied by --use-rollout-routing-replay, as in "
            "slime; alone (replaying the trainer's own old-log-prob routing) not implemented."
        },
    )
    ref_load: Optional[str] = field(
        default=None,
        metadata={
            "help": "The weights a run starts from and the KL reference model (slime's flag; "
            "a run resumed from --load keeps this reference): a --save directory (the policy of "
            "its latest checkpoint), one iter_NNNNNNN/ directory of it, slime's torch_dist "
            "(Megatron-LM) checkpoint, the output of `python -m trainer_bridge.convert "
            "hf-to-mcore` (any TP / EP size), or a Hugging Face checkpoint of the same model.",
            "unset": "--hf-checkpoint's weights",
        },
    )

    def __post_init__(self) -> None:
        if self.use_rollout_routing_replay:
            self.use_routing_replay = True  # slime's R3 implies its R2
        elif self.use_routing_replay:
            raise ValueError(
                "--use-routing-replay alone (slime's R2: replaying the routing of the trainer's "
                "own old-log-prob forward) is not implemented; use --use-rollout-routing-replay "
                "(R3: the engines' routing)"
            )
        if self.qkv_format not in QKV_FORMATS:
            raise ValueError(
                f"--qkv-format must be one of {', '.join(QKV_FORMATS)}; got {self.qkv_format!r}"
            )
        if self.enable_draft_training:
            self._check_draft_training()
        for name in (
            "micro_batch_size",
            "tensor_model_parallel_size",
            "expert_model_parallel_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}"
                )
        self._check_dynamic_batch_size()
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise ValueError(f"--global-batch-size must be positive, got {self.global_batch_size}")
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        if self.moe_router_bias_update_rate < 0:
            raise ValueError(
                "--moe-router-bias-update-rate must be >= 0, got "
                f"{self.moe_router_bias_update_rate}"
            )
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.draft_lr is not None:
            if self.draft_lr < 0:
                raise ValueError(f"--draft-lr must be >= 0, got {self.draft_lr}")
            if not (self.enable_mtp_training or self.enable_draft_training):
                raise ValueError(
                    "--draft-lr sets the learning rate of the draft trained online; add "
                    "--enable-mtp-training (the model's MTP layers) or --enable-draft-training "
                    "(an external EAGLE-2/3 or STANDALONE draft)"
                )
            if self.bf16:
                raise ValueError(
                    "--draft-lr with --bf16 is not implemented: specrl scales the MTP layers' "
                    "update on the model's parameters, and with --bf16 the optimizer steps "
                    "float32 master copies of them; drop one of the two flags"
                )

    @property
    def expert_tp(self) -> int:
        """--expert-tensor-parallel-size, its default resolved (--tensor-model-parallel-size)."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    def _check_dynamic_batch_size(self) -> None:
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise ValueError(
                "--use-dynamic-batch-size needs --max-tokens-per-gpu (the token budget of a micro "
                "batch), as in slime"
            )
        if (
            self.use_dynamic_batch_size
            and self.qkv_format == "bshd"
            and self.expert_model_parallel_size > 1
        ):
            raise ValueError(
                "--use-dynamic-batch-size with --qkv-format bshd at --expert-model-parallel-size > "
                "1 is not supported: the expert ranks' padded micro batches would hold different "
                "numbers of rows, which megatron's allgather dispatcher cannot exchange; use "
                "--qkv-format thd (slime always packs)"
            )
        for name in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.log_probs_max_tokens_per_gpu is None:
            self.log_probs_max_tokens_per_gpu = self.max_tokens_per_gpu

    def _check_draft_training(self) -> None:
        if self.enable_mtp_training:
            raise ValueError(
                "--enable-draft-training and --enable-mtp-training each train the draft the "
                "engines use (an external EAGLE-2/3 draft, the model's MTP layers); give the one "
                "matching --sglang-speculative-algorithm"
            )
        if self.qkv_format == "thd":
            raise ValueError(
                "--enable-draft-training with --qkv-format thd is not implemented: the online "
                "draft trains on the policy's [batch, sequence] hidden states and logits, which "
                "a packed micro batch does not have; use --qkv-format bshd"
            )
        if self.bf16:
            raise ValueError(
                "--enable-draft-training with --bf16 is not implemented yet (as --draft-lr is "
                "not): the draft's float32 training on bfloat16 policy features is untested; "
                "drop --bf16 or the flag"
            )
        if self.draft_checkpoint is None:
            raise ValueError(
                "--enable-draft-training trains the engines' external draft: give its "
                "checkpoint (--sglang-speculative-draft-model-path)"
            )


def check_mtp_flags(
    args: TrainerArgs | argparse.Namespace, in_checkpoint: int, architecture: str
) -> None:
    """slime's --mtp-num-layers must match the MTP layers the checkpoint has, and
    --enable-mtp-training needs some."""
    checkpoint = args.hf_checkpoint
    requested = args.mtp_num_layers
    if requested is not None and requested != in_checkpoint:
        raise ValueError(
            f"--mtp-num-layers {requested}: {checkpoint} has {in_checkpoint} MTP layers "
            "(num_nextn_predict_layers), and specrl builds the ones the checkpoint has; give "
            f"{in_checkpoint} or leave the flag out"
        )
    if args.enable_mtp_training and not in_checkpoint:
        raise ValueError(
            f"--enable-mtp-training needs a model with MTP layers; {checkpoint} ({architecture}) "
            "has none"
        )
