"""Resolving the engine's configuration once: auto values, the checkpoints' configs, the draft.

`resolve_engine_config` turns EngineArgs into an EngineConfig that every part of the engine
reads: no auto value is left, the target's and the draft's configs are read once, the draft
kind and the target layers an EAGLE-3 draft reads are decided here. Combinations that cannot
work are refused naming the flag to change.
"""

from __future__ import annotations

import dataclasses
import enum
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
from spec_engine.attention import flashinfer_installed
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.registry import model_class


class DraftKind(enum.Enum):
    """Which draft model a model-based speculative algorithm runs."""

    EAGLE = "EAGLE"  # EAGLE-2 draft (LlamaForCausalLMEagle) over target features
    EAGLE3 = "EAGLE3"  # EAGLE-3 draft over three captured target layers
    MTP = "MTP"  # the target's own multi-token-prediction layers (MiMo)
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
    args = resolve_auto(
        args,
        cuda_available=cuda_available,
        checkpoint_dtype=target.torch_dtype,
        head_dim=target.head_dim,
    )
    context_len = context_length(target, args)
    path = args.speculative_draft_model_path
    draft = ModelConfig.from_pretrained(path) if path is not None else None
    args = resolve_speculative(args, target, draft, context_len)
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
    fits = head_dim is None or head_dim in FLASHINFER_HEAD_DIMS
    half = dtype in ("bfloat16", "float16", "bf16", "fp16", "half")
    backend = args.attention_backend or (
        "flashinfer"
        if device == "cuda" and fits and half and flashinfer_installed()
        else "torch_native"
    )
    if backend == "flashinfer":
        if device != "cuda":
            raise ValueError(
                "--attention-backend flashinfer needs CUDA; use --attention-backend torch_native "
                "on CPU"
            )
        if not flashinfer_installed():
            raise ValueError(
                "--attention-backend flashinfer needs the flashinfer-python package: pip install "
                "'specrl[gpu]', or use --attention-backend torch_native"
            )
        if not fits:
            raise ValueError(
                f"--attention-backend flashinfer has no kernels for head_dim {head_dim} (it has "
                f"{FLASHINFER_HEAD_DIMS}); use --attention-backend torch_native"
            )
        if not half:
            raise ValueError(
                f"--attention-backend flashinfer has no {dtype} kernels; use --dtype bfloat16 or "
                "float16, or --attention-backend torch_native"
            )
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
    )


def resolve_speculative(
    args: EngineArgs, target: ModelConfig, draft: Optional[ModelConfig], context_len: int
) -> EngineArgs:
    """Fill the auto speculative values (SGLang's defaults) and refuse combinations that cannot
    work, naming the flag to change. Returns `args` unchanged without speculation."""
    algo = args.speculative_algorithm
    if algo is None:
        return args
    path = args.speculative_draft_model_path
    if algo == "NGRAM":
        if path is not None:
            raise ValueError(
                "--speculative-algorithm NGRAM uses no draft model; drop "
                "--speculative-draft-model-path"
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
    if path is None and not (algo == "EAGLE" and target.num_mtp_layers > 0):
        raise ValueError(
            f"--speculative-algorithm {algo} needs --speculative-draft-model-path"
            + ("" if algo != "EAGLE" else " (or a target with MTP layers)")
        )
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
        steps, topk, tokens = (
            (5, 4, 8)
            if target.architecture == "LlamaForCausalLM" and algo != "STANDALONE"
            else (3, 1, 4)
        )
    topk = topk or 1
    if topk == 1:
        tokens = steps + 1  # a chain: the root and one token per step
    elif tokens is None:
        raise ValueError(
            f"with --speculative-eagle-topk {topk}, set --speculative-num-draft-tokens (at most "
            f"{topk * steps + 1})"
        )
    if tokens > topk * steps + 1:
        raise ValueError(
            f"--speculative-num-draft-tokens {tokens} exceeds topk * steps + 1 = "
            f"{topk * steps + 1}; lower it"
        )
    if tokens < 2:
        raise ValueError(f"--speculative-num-draft-tokens must be at least 2, got {tokens}")
    if draft is not None:
        _check_draft(DraftKind(algo), target, draft, context_len)
    return dataclasses.replace(
        args,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=tokens,
    )


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
    if draft.vocab_size != target.vocab_size:
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
        raise ValueError(
            f"the draft's context ({draft.max_position_embeddings} positions) is shorter than the "
            f"target's context length {context_len}; lower --context-length to at most "
            f"{draft.max_position_embeddings} (a shorter draft context caused illegal memory "
            "accesses in SGLang)"
        )
