"""What --tp-size > 1 runs today, checked against the model and the other flags once they are
resolved: Llama, Qwen2, Qwen3, MiMo, GLM-4.5 and DeepSeek-V3 targets (MoE experts split by TP
or by EP groups, MLA by heads), unquantized or block-FP8 (split only between FP8 blocks, as
SGLang splits them), eager forwards on CUDA (their emulated graphs on the CPU); plain decoding,
and speculative decoding with its drafts at the target's TP (NGRAM; EAGLE-2, EAGLE-3 and
STANDALONE drafts; the MTP layers of MiMo, GLM-4.5 and DeepSeek-V3). Each refusal names what
works instead."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from spec_engine.distributed.parallel_state import TPGroup, use_tp_group
from spec_engine.distributed.partition import attention_heads, divide
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.registry import model_class
from spec_engine.weights.loader import check_fp8_partitions

# core/timeouts.py's variables (read here by name: args/ does not import core/).
_TIMEOUT_VARIABLES = (
    "SGLANG_REQ_WAITING_TIMEOUT",
    "SGLANG_QUEUED_TIMEOUT_MS",
    "SGLANG_REQ_RUNNING_TIMEOUT",
    "SGLANG_FORWARD_TIMEOUT_MS",
)


def check_expert_parallel(ep: int, tp: int, target: ModelConfig) -> None:
    """Refuse an --ep-size that does not divide --tp-size (SGLang's moe_tp_size = tp_size /
    ep_size ranks share each expert group), or one the experts do not divide (the features
    divide by --tp-size: check_tensor_parallel)."""
    if ep == 1:
        return
    flag = f"--ep-size {ep}"
    if tp % ep:
        divisors = [d for d in range(1, tp + 1) if tp % d == 0]
        raise ValueError(
            f"{flag} with --tp-size {tp}: the experts are split into --ep-size groups, each "
            f"over --tp-size / --ep-size ranks (SGLang's moe_tp_size), so --ep-size must divide "
            f"--tp-size; set --ep-size to one of {divisors}"
        )
    if target.moe is None:
        raise ValueError(f"{flag}: {target.architecture} has no MoE layers; drop --ep-size")
    if target.moe.num_experts % ep:
        raise ValueError(
            f"{flag}: the {target.moe.num_experts} routed experts do not split evenly into "
            f"{ep} groups; pick an --ep-size that divides them, or --ep-size 1"
        )


def check_tensor_parallel(
    args: Any, target: ModelConfig, draft: Optional[ModelConfig] = None
) -> None:
    """Refuse a --tp-size the model, its draft (`draft`: an external draft's config) or the
    other flags cannot run at (ValueError)."""
    n = args.tp_size
    check_expert_parallel(args.ep_size, n, target)
    if n == 1:
        return
    flag = f"--tp-size {n}"
    if args.speculative_algorithm is not None:
        _check_speculation(args, target, draft, flag)
    timeouts = [name for name in _TIMEOUT_VARIABLES if os.environ.get(name)]
    if timeouts:
        raise ValueError(
            f"{flag}: {', '.join(timeouts)} set: SGLANG_REQ_WAITING_TIMEOUT / "
            "SGLANG_REQ_RUNNING_TIMEOUT (and their older names) are decided on each "
            "rank's own clock, and ranks must abort the same requests; unset them at --tp-size > "
            "1 (abort late requests with /abort_request instead)"
        )
    attention_heads(target.num_attention_heads, target.num_key_value_heads, 0, n)
    divide(target.intermediate_size, n, "intermediate_size")
    if target.moe is not None:
        divide(target.moe.intermediate_size, n, "moe_intermediate_size")
    if target.weight_block_size is not None:
        _check_fp8_blocks(target, n, args.ep_size, flag)
    if args.device == "cuda":
        if not args.disable_cuda_graph:
            raise ValueError(
                f"{flag}: CUDA graphs are not captured with the collectives inside yet; add "
                "--disable-cuda-graph (the ranks then run eagerly)"
            )
        gpus = torch.cuda.device_count()
        per_node = n // args.nnodes  # each node's ranks: GPUs base_gpu_id.. on that node
        last = args.base_gpu_id + per_node - 1
        if last >= gpus:
            nodes = f" over --nnodes {args.nnodes}" if args.nnodes > 1 else ""
            raise ValueError(
                f"{flag}{nodes} from --base-gpu-id {args.base_gpu_id} needs GPUs "
                f"{args.base_gpu_id}..{last}, and this machine has {gpus}"
            )


def _check_fp8_blocks(target: ModelConfig, tp: int, ep: int, flag: str) -> None:
    """Block-FP8 weights (an FP8 checkpoint, --quantization fp8) split over the ranks only
    between blocks: checked on the target built on the meta device as rank 0 builds it (every
    rank's blocks are as long; its MTP layers have the trunk's shapes)."""
    with use_tp_group(TPGroup(rank=0, size=tp, ep_size=ep)), torch.device("meta"):
        model = model_class(target)(target)
    try:
        check_fp8_partitions(model, target.weight_block_size)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _check_speculation(
    args: Any, target: ModelConfig, draft: Optional[ModelConfig], flag: str
) -> None:
    """The drafts run at the target's TP (as SGLang's): their layers split like the target's."""
    algorithm = args.speculative_algorithm
    mtp = algorithm == "EAGLE" and args.speculative_draft_model_path is None
    if args.speculative_token_map is not None:
        raise ValueError(
            f"{flag}: --speculative-token-map (FR-Spec) takes rows of the whole LM head, which "
            "is split by vocabulary over the ranks; drop it at --tp-size > 1 (the draft then "
            "proposes over the full vocabulary) or serve it at --tp-size 1"
        )
    if draft is not None and not mtp:
        where = f"the draft {args.speculative_draft_model_path!r}: "
        try:
            attention_heads(draft.num_attention_heads, draft.num_key_value_heads, 0, args.tp_size)
            divide(draft.intermediate_size, args.tp_size, "intermediate_size")
        except ValueError as e:
            raise ValueError(where + str(e)) from e
