"""Resolving the engine's configuration once: auto values, the checkpoints' configs, the draft.

`resolve_engine_config` turns EngineArgs into an EngineConfig that every part of the engine
reads: no auto value is left, the target's and the draft's configs are read once, the draft
kind and the target layers an EAGLE-3 draft reads are decided here. Combinations that cannot
work are refused naming the flag to change.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import random
from dataclasses import dataclass
from typing import Optional

from spec_engine.args.engine_args import (
    CHUNKED_PREFILL_CPU,
    CHUNKED_PREFILL_CUDA,
    FLASHINFER_HEAD_DIMS,
    MAX_RUNNING_REQUESTS_DEFAULT,
    MEM_FRACTION_CPU,
    MEM_FRACTION_CUDA,
    NGRAM_DEFAULT_DRAFT_TOKENS,
    EngineArgs,
)
from spec_engine.args.spec_checks import check_multi_layer_eagle
from spec_engine.args.tp_checks import check_tensor_parallel
from spec_engine.attention import flashinfer_installed
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.registry import model_class, multi_layer_mtp
from spec_engine.weights.fp8 import DEFAULT_BLOCK

logger = logging.getLogger(__name__)


class DraftKind(enum.Enum):
    """Which draft model a model-based speculative algorithm runs."""

    EAGLE = "EAGLE"  # EAGLE-2 draft (LlamaForCausalLMEagle) over target features
    EAGLE3 = "EAGLE3"  # EAGLE-3 draft over three captured target layers
    MTP = "MTP"  # the target's own multi-token-prediction layers (MiMo, GLM-4.5)
    STANDALONE = "STANDALONE"  # a small LM drafting from tokens alone

    @property
    def uses_target_features(self) -> bool:
        """Every draft but a STANDALONE one reads the target's hidden states."""
        return self is not DraftKind.STANDALONE

    @property
    def external(self) -> bool:
        """A checkpoint of its own (an MTP draft's weights are the target checkpoint's)."""
        return self is not DraftKind.MTP

    @classmethod
    def of(cls, algorithm: Optional[str], draft_path: Optional[str]) -> Optional[DraftKind]:
        """The draft of `--speculative-algorithm` (None: no draft model). EAGLE without a draft
        path drafts with the target's MTP layers."""
        if algorithm is None or algorithm == "NGRAM":
            return None
        if algorithm == "EAGLE" and draft_path is None:
            return cls.MTP
        return cls(algorithm)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine's parts read, resolved once (see resolve_engine_config)."""

    args: EngineArgs  # no auto value left
    target: ModelConfig  # rope tables sized for context + speculative positions
    context_len: int  # tokens per request, prompt and output
    extra_positions: int  # positions past a request's end a speculative step touches
    draft_kind: Optional[DraftKind] = None
    draft: Optional[ModelConfig] = None  # the draft's config (MTP: the target's)
    draft_checkpoint: Optional[str] = None  # where the draft's weights are (MTP: the target)
    capture_layers: tuple[int, ...] = ()  # target layers whose input an EAGLE-3 draft reads
    # A STANDALONE draft that is the target's own checkpoint: the draft runs the target model on
    # the target's KV cache (a second copy of either would hold the same values).
    self_draft: bool = False


def resolve_engine_config(args: EngineArgs, cuda_available: bool) -> EngineConfig:
    """Read the checkpoints' configs and fill every auto value of `args`."""
    if args.model_path is None:
        raise ValueError("model_path is required: a Hugging Face checkpoint directory")
    target = ModelConfig.from_pretrained(args.model_path)
    if target.is_draft:
        raise ValueError(
            f"--model-path is a {target.architecture} draft; pass it as "
            "--speculative-draft-model-path and give the target model as --model-path"
        )
    target, args = resolve_quantization(target, args)
    args = resolve_auto(
        args,
        cuda_available=cuda_available,
        checkpoint_dtype=target.torch_dtype,
        head_dim=target.head_dim,
        mla=target.mla is not None,
    )
    context_len = context_length(target, args)
    path = args.speculative_draft_model_path
    draft = ModelConfig.from_pretrained(path) if path is not None else None
    args = resolve_speculative(args, target, draft, context_len)
    check_tensor_parallel(args, target, draft)
    extra = speculative_positions(args)
    rope_rows = max(target.max_position_embeddings, context_len) + extra
    target = dataclasses.replace(target, rope_max_positions=rope_rows)
    kind = DraftKind.of(args.speculative_algorithm, path)
    if kind is None:
        return EngineConfig(args, target, context_len, extra)
    if kind is DraftKind.MTP:
        draft, path = target, args.model_path
    draft = dataclasses.replace(draft, rope_max_positions=rope_rows)
    capture: tuple[int, ...] = ()
    if kind is DraftKind.EAGLE3:
        capture = model_class(target).eagle3_capture_layers(target, draft.eagle_aux_layer_ids)
    self_draft = kind is DraftKind.STANDALONE and os.path.realpath(path) == os.path.realpath(
        args.model_path
    )
    return EngineConfig(args, target, context_len, extra, kind, draft, path, capture, self_draft)


def resolve_quantization(target: ModelConfig, args: EngineArgs) -> tuple[ModelConfig, EngineArgs]:
    """The FP8 block the engine serves the target (and its MTP layers) in: the checkpoint's
    weight_block_size, else with --quantization fp8 DeepSeek-V3's 128 x 128; --quantization
    resolved to fp8 whenever there is one (SGLang reads it off the checkpoint too)."""
    block = target.weight_block_size
    if block is None and args.quantization == "fp8":
        block = DEFAULT_BLOCK
        target = dataclasses.replace(target, weight_block_size=block)
    return target, dataclasses.replace(args, quantization="fp8" if block else None)


def context_length(model_config: ModelConfig, args: EngineArgs) -> int:
    """--context-length, or the model's max_position_embeddings; larger is refused."""
    limit = model_config.max_position_embeddings
    if args.context_length is None:
        return limit
    if args.context_length > limit:
        raise ValueError(
            f"--context-length {args.context_length} exceeds the model's max_position_embeddings "
            f"({limit}); lower it"
        )
    return args.context_length


def resolve_auto(
    args: EngineArgs,
    *,
    cuda_available: bool,
    checkpoint_dtype: Optional[str],
    head_dim: Optional[int] = None,
    mla: bool = False,
) -> EngineArgs:
    """Return a copy of `args` with every `auto`/None default replaced by a concrete value
    (`head_dim`: the target's, which decides whether FlashInfer has kernels for it)."""
    if args.model_path is None:
        raise ValueError("--model-path is required: a Hugging Face checkpoint directory")
    device = args.device
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    if device == "cuda" and not cuda_available:
        raise ValueError(
            "--device cuda was given but CUDA is not available; use --device cpu or auto"
        )
    dtype = args.dtype
    if dtype == "auto":
        if device == "cpu":
            dtype = "float32"
        else:
            dtype = checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16") else "bfloat16"
    backend = attention_backend(args.attention_backend, device, dtype, head_dim, mla)
    if args.enable_deterministic_inference and backend != "torch_native":
        if args.attention_backend == "flashinfer":
            raise ValueError(
                "--enable-deterministic-inference needs batch-invariant attention, which specrl "
                "implements in torch_native only: drop --attention-backend flashinfer or pass "
                "--attention-backend torch_native"
            )
        backend = "torch_native"
    chunk = args.chunked_prefill_size
    if chunk is None:
        chunk = CHUNKED_PREFILL_CUDA if device == "cuda" else CHUNKED_PREFILL_CPU
    if chunk != -1 and chunk % args.page_size != 0:
        raise ValueError(
            f"--chunked-prefill-size {chunk} must be a multiple of --page-size {args.page_size}"
        )
    return dataclasses.replace(
        args,
        device=device,
        dtype=dtype,
        attention_backend=backend,
        chunked_prefill_size=chunk,
        max_running_requests=args.max_running_requests or MAX_RUNNING_REQUESTS_DEFAULT,
        tokenizer_path=args.tokenizer_path or args.model_path,
        served_model_name=args.served_model_name or args.model_path,
        random_seed=args.random_seed if args.random_seed is not None else random.randrange(2**31),
        mem_fraction_static=args.mem_fraction_static
        or (MEM_FRACTION_CUDA if device == "cuda" else MEM_FRACTION_CPU),
        **overlap_schedule(args),
    )


def overlap_schedule(args: EngineArgs) -> dict[str, bool]:
    """The two overlap flags as the engine runs them (get_server_info reports these): on unless
    --disable-overlap-schedule, as in SGLang; auto is off with speculation, whose steps do not
    overlap yet (an explicit --enable-overlap-schedule is kept for when they do)."""
    enable = args.enable_overlap_schedule
    if args.disable_overlap_schedule:
        enable = False
    elif enable is None:
        enable = args.speculative_algorithm is None
    return dict(enable_overlap_schedule=enable, disable_overlap_schedule=not enable)


def attention_backend(
    requested: Optional[str],
    device: str,
    dtype: str,
    head_dim: Optional[int],
    mla: bool = False,
) -> str:
    """The attention backend that runs: flashinfer where it can (CUDA, installed, 16-bit,
    head_dim it has kernels for), else torch_native. A requested backend that cannot run here,
    or one specrl does not have (SGLang's fa3, triton, ...), is replaced, with one log line."""
    why_not = None
    if device != "cuda":
        why_not = "no CUDA device"
    elif not flashinfer_installed():
        why_not = "flashinfer-python is not installed (pip install 'specrl[gpu]')"
    elif mla:
        why_not = "specrl's flashinfer backend has no MLA kernels (DeepSeek-V3)"
    elif head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        why_not = f"flashinfer has no kernels for head_dim {head_dim}"
    elif dtype not in ("bfloat16", "float16"):
        why_not = f"flashinfer has no {dtype} kernels"
    usable = "torch_native" if why_not else "flashinfer"
    if requested in (None, "torch_native", usable):
        return requested or usable
    if requested == "flashinfer":
        logger.warning(
            "--attention-backend flashinfer cannot run here (%s); using torch_native", why_not
        )
    else:
        logger.warning(
            "--attention-backend %s: specrl has no %s kernels; using %s%s (SGLang's fa3/triton "
            "workaround for draft-stage CUDA-graph padding is not needed: specrl checks padded "
            "replays with --cuda-graph-self-check)",
            requested,
            requested,
            usable,
            f" ({why_not})" if why_not else "",
        )
    return usable


def resolve_speculative(
    args: EngineArgs, target: ModelConfig, draft: Optional[ModelConfig], context_len: int
) -> EngineArgs:
    """Fill the auto speculative values (SGLang's defaults) and refuse combinations that cannot
    work, naming the flag to change. Returns `args` unchanged without speculation."""
    algo = args.speculative_algorithm
    if algo in (None, "NGRAM") and args.enable_multi_layer_eagle:
        raise ValueError(
            "--enable-multi-layer-eagle drafts with the target's MTP layers: use it with "
            "--speculative-algorithm EAGLE or NEXTN"
        )
    if algo is None:
        return args
    if algo == "NGRAM":
        return resolve_ngram(args)
    path = args.speculative_draft_model_path
    if path is None and not (algo == "EAGLE" and target.num_mtp_layers > 0):
        raise ValueError(
            f"--speculative-algorithm {algo} needs --speculative-draft-model-path"
            + ("" if algo != "EAGLE" else " (or a target with MTP layers)")
        )
    steps, topk, tokens = draft_tree(args, target)
    multi_layer = path is None and multi_layer_mtp(target)
    check_multi_layer_eagle(args, multi_layer, target.num_mtp_layers, steps, topk)
    if draft is not None:
        _check_draft(DraftKind(algo), target, draft, context_len)
        if DraftKind(algo) is DraftKind.STANDALONE and draft.vocab_size != target.vocab_size:
            check_same_tokenizer(args.tokenizer_path or args.model_path, path, target, draft)
    return dataclasses.replace(
        args,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=tokens,
    )


def resolve_ngram(args: EngineArgs) -> EngineArgs:
    """NGRAM: the tokens verified per step (auto: NGRAM_DEFAULT_DRAFT_TOKENS), and no flag of a
    draft model or of a drafted tree."""
    if args.enable_deterministic_inference:
        raise ValueError(
            "--enable-deterministic-inference cannot hold with --speculative-algorithm NGRAM: "
            "its drafts come from an n-gram cache shared by all requests, so a request's "
            "draft trees (and with them its sampled tokens and log-prob bits) depend on the "
            "other requests. Use EAGLE, EAGLE3, NEXTN or STANDALONE, whose drafts are per "
            "request, or no speculation"
        )
    if args.speculative_draft_model_path is not None:
        raise ValueError(
            "--speculative-algorithm NGRAM uses no draft model; drop --speculative-draft-model-path"
        )
    if args.speculative_num_steps is not None or args.speculative_eagle_topk is not None:
        raise ValueError(
            "NGRAM builds its own draft trees: set only --speculative-num-draft-tokens and the "
            "--speculative-ngram-* flags, not --speculative-num-steps / "
            "--speculative-eagle-topk"
        )
    tokens = args.speculative_num_draft_tokens or NGRAM_DEFAULT_DRAFT_TOKENS
    if tokens < 2:
        raise ValueError(
            "--speculative-num-draft-tokens must be at least 2 (the root and one draft), got "
            f"{tokens}"
        )
    return dataclasses.replace(args, speculative_num_draft_tokens=tokens)


def draft_tree(args: EngineArgs, target: ModelConfig) -> tuple[int, int, int]:
    """(steps, topk, draft tokens) of a model draft's tree: SGLang's auto values when no
    --speculative-num-steps is given, the tokens of a chain (topk 1) set to steps + 1, and a
    tree larger than its steps and topk can propose refused."""
    steps, topk, tokens = (
        args.speculative_num_steps,
        args.speculative_eagle_topk,
        args.speculative_num_draft_tokens,
    )
    if steps is None:
        if topk is not None or tokens is not None:
            raise ValueError(
                "--speculative-eagle-topk / --speculative-num-draft-tokens need "
                "--speculative-num-steps too"
            )
        llama = target.architecture == "LlamaForCausalLM"
        steps, topk, tokens = (
            (5, 4, 8) if llama and args.speculative_algorithm != "STANDALONE" else (3, 1, 4)
        )
    topk = topk or 1
    if topk == 1 and tokens != steps + 1:
        if tokens is not None:  # SGLang adjusts it the same way, with a warning
            logger.warning(
                "--speculative-num-draft-tokens %d is adjusted to --speculative-num-steps + 1 = "
                "%d: with --speculative-eagle-topk 1 the draft is a chain",
                tokens,
                steps + 1,
            )
        tokens = steps + 1
    elif tokens is None:
        raise ValueError(
            f"with --speculative-eagle-topk {topk}, set --speculative-num-draft-tokens (at most "
            f"{max_draft_tokens(steps, topk)})"
        )
    if tokens > max_draft_tokens(steps, topk):
        raise ValueError(
            f"--speculative-num-draft-tokens {tokens} exceeds the {max_draft_tokens(steps, topk)} "
            f"tokens a draft of {steps} steps with top-{topk} proposes (the root, {topk} "
            f"candidates at the first step and {topk}x{topk} at each later one); lower it or "
            "raise --speculative-num-steps / --speculative-eagle-topk"
        )
    return steps, topk, tokens


def max_draft_tokens(steps: int, topk: int) -> int:
    """The most tokens a verify step can check: the root, then the draft's candidates (topk at
    the first step, topk x topk at each later one; SGLang's EAGLE draft tree)."""
    return 1 + topk + (steps - 1) * topk * topk


def speculative_positions(args: EngineArgs) -> int:
    """Positions past a request's last token that a speculative step may touch (verify tokens,
    and draft steps one further for a STANDALONE draft)."""
    if args.speculative_algorithm is None:
        return 0
    return max(args.speculative_num_draft_tokens, (args.speculative_num_steps or 0) + 1)


# The checkpoint format each external draft kind loads (SGLang's class names).
DRAFT_ARCHITECTURES = {
    DraftKind.EAGLE: "LlamaForCausalLMEagle",
    DraftKind.EAGLE3: "LlamaForCausalLMEagle3",
}


def _check_draft(
    kind: DraftKind, target: ModelConfig, draft: ModelConfig, context_len: int
) -> None:
    expected = DRAFT_ARCHITECTURES.get(kind)
    if expected is not None and draft.architecture != expected:
        raise ValueError(
            f"--speculative-algorithm {kind.value} needs a {expected} draft; "
            f"--speculative-draft-model-path is a {draft.architecture}"
        )
    if kind is DraftKind.STANDALONE and draft.is_draft:
        raise ValueError(
            f"--speculative-algorithm STANDALONE needs a plain LM draft, not {draft.architecture}; "
            "use EAGLE / EAGLE3 for EAGLE drafts"
        )
    if kind is not DraftKind.STANDALONE and draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft.vocab_size}) differs from the target's "
            f"({target.vocab_size}); "
            "--speculative-draft-model-path must be a draft for this target"
        )
    target_hidden = draft.target_hidden_size or draft.hidden_size
    if kind in DRAFT_ARCHITECTURES and target_hidden != target.hidden_size:
        raise ValueError(
            f"draft expects target hidden size {target_hidden}, the target has "
            f"{target.hidden_size}; "
            "--speculative-draft-model-path must be a draft for this target"
        )
    if draft.max_position_embeddings < context_len:
        # SGLang PR 9388: the draft runs at the target's context (its rope tables are sized for
        # it); EAGLE drafts are published with 2048 positions while serving longer contexts.
        logger.warning(
            "the draft's max_position_embeddings (%d) is below the target's context length %d; "
            "the draft runs with its context raised to %d",
            draft.max_position_embeddings,
            context_len,
            context_len,
        )


def check_same_tokenizer(
    target_path: str, draft_path: str, target: ModelConfig, draft: ModelConfig
) -> None:
    """A STANDALONE draft may pad its embedding rows differently (Qwen2.5-7B has 152064,
    Qwen2.5-1.5B 151936) when both tokenize alike: same tokens, same ids."""
    from transformers import AutoTokenizer

    sizes = (
        f"the draft's vocab_size is {draft.vocab_size} ({draft_path}), the target's "
        f"{target.vocab_size} ({target_path})"
    )
    vocabs = []
    for path in (target_path, draft_path):
        try:
            vocabs.append(AutoTokenizer.from_pretrained(path, local_files_only=True).get_vocab())
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{sizes}; a STANDALONE draft with another vocab_size needs the same tokenizer, "
                f"and none could be read from {path!r} ({e})"
            ) from None
    if vocabs[0] != vocabs[1]:
        raise ValueError(
            f"{sizes}, and their tokenizers differ; a STANDALONE draft must share the target's "
            "tokenizer"
        )
