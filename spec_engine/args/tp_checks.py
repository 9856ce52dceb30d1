"""What --tp-size > 1 runs today, checked against the model and the other flags once they are
resolved: Llama, Qwen2, Qwen3, MiMo, GLM-4.5 and DeepSeek-V3 targets (MoE experts split by TP,
MLA by heads), unquantized, plain decoding, eager forwards on CUDA (their emulated graphs on the
CPU). Each refusal names what works instead."""

from __future__ import annotations

import os
from typing import Any

import torch

from spec_engine.distributed.partition import attention_heads, divide
from spec_engine.models.hf_config import ModelConfig

# core/timeouts.py's variables (read here by name: args/ does not import core/).
_TIMEOUT_VARIABLES = (
    "SGLANG_REQ_WAITING_TIMEOUT",
    "SGLANG_QUEUED_TIMEOUT_MS",
    "SGLANG_REQ_RUNNING_TIMEOUT",
    "SGLANG_FORWARD_TIMEOUT_MS",
)


def check_expert_parallel(ep: int, tp: int, target: ModelConfig) -> None:
    """Refuse an --ep-size other than 1 or --tp-size, or one the experts do not divide."""
    if ep == 1:
        return
    flag = f"--ep-size {ep}"
    if ep != tp:
        raise ValueError(
            f"{flag} with --tp-size {tp}: experts are split whole over all the ranks (--ep-size "
            f"equal to --tp-size) or by features (--ep-size 1); set --ep-size {tp} or 1"
        )
    if target.moe is None:
        raise ValueError(f"{flag}: {target.architecture} has no MoE layers; drop --ep-size")
    if target.moe.num_experts % ep:
        raise ValueError(
            f"{flag}: the {target.moe.num_experts} routed experts do not split evenly over "
            f"{ep} ranks; pick an --ep-size that divides them, or --ep-size 1"
        )


def check_tensor_parallel(args: Any, target: ModelConfig) -> None:
    """Refuse a --tp-size the model or the other flags cannot run at (ValueError)."""
    n = args.tp_size
    check_expert_parallel(args.ep_size, n, target)
    if n == 1:
        return
    flag = f"--tp-size {n}"
    if args.speculative_algorithm is not None:
        raise ValueError(
            f"{flag}: speculative decoding ({args.speculative_algorithm}) runs at --tp-size 1 "
            "for now; drop --speculative-algorithm to decode plainly over the ranks"
        )
    if target.weight_block_size is not None:
        raise ValueError(
            f"{flag}: block-FP8 weights (an FP8 checkpoint or --quantization fp8) are not split "
            "across ranks yet (a rank's block of a weight needs its block scales); serve them at "
            "--tp-size 1, or the BF16 checkpoint at --tp-size > 1"
        )
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
    if args.device == "cuda":
        if not args.disable_cuda_graph:
            raise ValueError(
                f"{flag}: CUDA graphs are not captured with the collectives inside yet; add "
                "--disable-cuda-graph (the ranks then run eagerly)"
            )
        gpus = torch.cuda.device_count()
        last = args.base_gpu_id + n - 1
        if last >= gpus:
            raise ValueError(
                f"{flag} from --base-gpu-id {args.base_gpu_id} needs GPUs "
                f"{args.base_gpu_id}..{last}, and this machine has {gpus}"
            )
