"""EngineArgs: every engine option under SGLang's ServerArgs name, and its CLI.

One dataclass is the single source of truth. `add_cli_args` generates argparse flags from it
(`--model-path` for the server, `--sglang-speculative-algorithm` when given a prefix inside a
launcher); help text comes from field metadata. `EngineArgs.__post_init__` checks everything
that can be checked without the model (spec_engine.args.engine_checks, and spec_checks for the
speculative flags); `spec_engine.args.resolve` fills the auto values once, from the device and
the checkpoints' configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from spec_engine.args.dataclass_cli import add_dataclass_args, dataclass_from_args
from spec_engine.args.engine_checks import (
    ATTENTION_BACKENDS,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    GRAMMAR_BACKENDS,
    LOG_LEVELS,
    ON_COLLAPSE_CHOICES,
    SCHEDULE_POLICIES,
    SGLANG_ATTENTION_BACKENDS,
    check_engine_args,
    normalize_dtype,
)
from spec_engine.args.sglang_compat import (
    SGLANG_FLAGS,
    CompatArgs,
    check_sglang_options,
    given_options,
)
from spec_engine.args.spec_checks import (
    SPECULATIVE_ALGORITHMS,
    canonical_algorithm,
    check_speculative,
)

FLASHINFER_HEAD_DIMS = (64, 128, 256)
NGRAM_DEFAULT_DRAFT_TOKENS = 12

# Auto chunked-prefill budgets: SGLang's default on large GPUs, and a smaller one for CPU
# where a 2048-token chunk already keeps the cores busy for a while.
CHUNKED_PREFILL_CUDA = 8192
CHUNKED_PREFILL_CPU = 2048
MAX_RUNNING_REQUESTS_DEFAULT = 256
# Fraction of memory given to weights + KV when --mem-fraction-static is unset. On CPU the
# engine shares RAM with the trainer and tests, so it takes far less than SGLang's GPU default.
MEM_FRACTION_CUDA = 0.88
MEM_FRACTION_CPU = 0.10


def _opt(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field carrying its CLI help (and optional `choices`/`metavar`)."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class EngineArgs:
    """Engine options. Names and defaults follow SGLang's ServerArgs where SGLang has them."""

    # Model and tokenizer
    model_path: Optional[str] = _opt(
        None,
        "Hugging Face checkpoint directory of the target model (config.json + *.safetensors).",
        aliases=("model",),
    )
    tokenizer_path: Optional[str] = _opt(None, "Tokenizer directory.", unset="--model-path")
    skip_tokenizer_init: bool = _opt(
        False, "Do not load a tokenizer: requests must give input_ids and outputs carry no text."
    )
    dtype: str = _opt(
        "auto",
        "Weight and activation dtype. auto: float32 on CPU, the checkpoint's 16-bit dtype (else "
        "bfloat16) on CUDA.",
        choices=DTYPE_CHOICES,
    )
    quantization: Optional[str] = _opt(
        None,
        "fp8: serve block-FP8 weights (the linears of attention and MLPs as float8_e4m3fn with a "
        "scale per 128x128 block, DeepSeek-V3's release format), quantized at load and on every "
        "weight update; a block-FP8 checkpoint implies it with its own block size. On CPU the "
        "engine holds the dequantized FP8 values (docs/checkpoints.md).",
        unset="the checkpoint's quantization_config (none: unquantized)",
    )
    device: str = _opt(
        "auto", "Device to run on. auto: CUDA when available, else CPU.", choices=DEVICE_CHOICES
    )
    context_length: Optional[int] = _opt(
        None,
        "Maximum tokens per request (prompt + output); larger values than the model's are refused.",
        unset="the model's max_position_embeddings",
    )
    served_model_name: Optional[str] = _opt(
        None, "Model name reported by the OpenAI-compatible API.", unset="--model-path"
    )
    chat_template: Optional[str] = _opt(
        None, "Path to a Jinja chat template.", unset="the tokenizer's own template"
    )
    # Server
    host: str = _opt("127.0.0.1", "HTTP server host.")
    port: int = _opt(30000, "HTTP server port.")
    api_key: Optional[str] = _opt(
        None,
        "If set, the HTTP server requires 'Authorization: Bearer <key>'.",
        unset="none: no authentication",
    )
    skip_server_warmup: bool = _opt(
        False, "Do not run a one-token warmup request when the server starts."
    )
    max_request_bytes: int = _opt(
        64 * 2**20, "Largest HTTP request body in bytes; larger ones get 413 (specrl's option)."
    )
    max_request_prompts: int = _opt(4096, "Most prompts in one request (specrl's option).")
    max_request_samples: int = _opt(
        16384, "Most samples (prompts x n) in one request (specrl's option)."
    )
    max_request_tokens: int = _opt(
        2**24,
        "Most tokens one request may ask for: prompt + max_new_tokens, summed over its samples "
        "(specrl's option).",
    )
    # Memory and scheduling
    mem_fraction_static: Optional[float] = _opt(
        None,
        f"Fraction of device memory for weights + KV cache (auto: {MEM_FRACTION_CUDA} on CUDA, "
        f"{MEM_FRACTION_CPU} of RAM on CPU). Ignored when --max-total-tokens is set.",
    )
    max_total_tokens: Optional[int] = _opt(
        None,
        "Size of the KV cache pool in tokens; overrides --mem-fraction-static.",
        unset="sized by --mem-fraction-static",
    )
    max_running_requests: Optional[int] = _opt(
        None, f"Maximum requests decoded together (auto: {MAX_RUNNING_REQUESTS_DEFAULT})."
    )
    chunked_prefill_size: Optional[int] = _opt(
        None,
        "Maximum prompt tokens prefilled in one forward; longer prompts are split into chunks. -1 "
        f"disables chunking (auto: {CHUNKED_PREFILL_CUDA} on CUDA, {CHUNKED_PREFILL_CPU} on CPU).",
    )
    max_prefill_tokens: int = _opt(16384, "Maximum prompt tokens in one prefill batch.")
    schedule_policy: str = _opt(
        "fcfs",
        "Order in which waiting requests are admitted: fcfs (arrival order) or random (SGLang's: "
        "the queue is shuffled before each prefill, seeded by --random-seed).",
        choices=SCHEDULE_POLICIES,
    )
    schedule_conservativeness: float = _opt(
        1.0,
        "Larger values reserve more KV for running requests' future tokens (fewer retractions, "
        "less concurrency).",
    )
    enable_overlap_schedule: Optional[bool] = _opt(
        None,
        "Overlap decode steps (SGLang's default): launch step N+1 before step N's tokens are "
        "read back (core/overlap.py; outputs are identical). auto: on for plain decoding, off "
        "with speculation; given, chain drafts (--speculative-eagle-topk 1) overlap too under "
        "--enable-deterministic-inference (speculative/chain_overlap.py).",
    )
    disable_overlap_schedule: bool = _opt(
        False, "SGLang's flag: never overlap steps (overrides --enable-overlap-schedule)."
    )
    page_size: int = _opt(1, "Tokens per KV cache page; the prefix cache shares whole pages.")
    disable_radix_cache: bool = _opt(
        False, "Disable the prefix (radix) cache: no KV sharing between requests."
    )
    enable_deterministic_inference: bool = _opt(
        False,
        "Batch-invariant numerics (SGLang's flag): a request's tokens and log-probs do not depend "
        "on what it is batched with or on prefix-cache hits, so a rerun with the same requests "
        "and seeds repeats bit for bit. Matmuls run on fixed-size row blocks and attention is "
        "computed with fixed-order reductions in torch_native (the backend this selects); slower "
        "(see docs/benchmarks/deterministic_cpu.md).",
    )
    random_seed: Optional[int] = _opt(
        None,
        "Seed for sampling; with the same seed and requests, sampled outputs repeat exactly (auto: "
        "random).",
    )
    stream_interval: int = _opt(1, "Stream an update every N generated tokens.")
    incremental_streaming_output: bool = _opt(
        False,
        "SGLang's flag: /generate streams disjoint segments (each chunk's text, output_ids and "
        "output log-probs are the new ones only) instead of the output so far.",
    )
    # Speculative decoding
    speculative_algorithm: Optional[str] = _opt(
        None,
        "EAGLE (EAGLE-2, or MTP when the target has MTP layers and no draft is given), EAGLE3, "
        "STANDALONE (a small LM as draft) or NGRAM (no draft model).",
        choices=SPECULATIVE_ALGORITHMS + ("NEXTN",),
        unset="none: no speculative decoding",
    )
    speculative_draft_model_path: Optional[str] = _opt(
        None,
        "Draft checkpoint: an EAGLE/EAGLE-3 draft, or a small LM for STANDALONE.",
        unset="none: EAGLE drafts with the target's MTP layers; NGRAM needs none",
    )
    speculative_num_steps: Optional[int] = _opt(
        None, "Draft depth (auto: 5 for Llama targets, 3 otherwise and for STANDALONE)."
    )
    speculative_eagle_topk: Optional[int] = _opt(
        None,
        "Branching factor of the draft tree per step (auto: 4 for Llama targets, 1 otherwise).",
    )
    speculative_num_draft_tokens: Optional[int] = _opt(
        None,
        "Tokens verified per step, the root included (auto: 8 for Llama targets, 4 otherwise, "
        f"{NGRAM_DEFAULT_DRAFT_TOKENS} for NGRAM; steps + 1 when topk is 1).",
    )
    speculative_accept_threshold_single: float = _opt(
        1.0, "Accept a draft token whose target probability reaches this (1.0 = lossless)."
    )
    speculative_accept_threshold_acc: float = _opt(
        1.0, "Scale the acceptance test by 1/this (1.0 = lossless; lower accepts more, lossy)."
    )
    enable_multi_layer_eagle: bool = _opt(
        False,
        "MTP with several next-n layers (DeepSeek-V3): draft step k runs MTP layer k, as SGLang's "
        "multi-layer EAGLE (a chain: topk 1, steps <= the layers); off, every step runs layer 0.",
    )
    speculative_token_map: Optional[str] = _opt(
        None,
        "FR-Spec: a .pt tensor of hot token ids restricting the EAGLE draft head (verification "
        "stays full-vocabulary).",
        unset="none: the draft head's full vocabulary",
    )
    speculative_ngram_min_match_window_size: int = _opt(
        1, "NGRAM: shortest context suffix matched against the n-gram cache."
    )
    speculative_ngram_max_match_window_size: int = _opt(
        12, "NGRAM: longest context suffix matched."
    )
    speculative_ngram_min_bfs_breadth: int = _opt(
        1, "NGRAM: branching of the draft tree for the longest matches."
    )
    speculative_ngram_max_bfs_breadth: int = _opt(
        10, "NGRAM: branching of the draft tree for the shortest matches."
    )
    speculative_ngram_branch_length: int = _opt(
        18, "NGRAM: tokens stored per cached branch (must exceed the max match window)."
    )
    speculative_ngram_capacity: int = _opt(
        10_000_000, "NGRAM: maximum nodes in the n-gram cache (it is cleared when full)."
    )
    speculative_adaptive: bool = _opt(
        False,
        "Choose per decode step whether to speculate and how deep, from the running batch size "
        "and a cost model measured online (time per plain step and per speculative step at each "
        "depth per batch-size bucket, accept length per depth): run the mode expected to emit "
        "the most tokens/s. Any algorithm; the tree flags are the deepest shape it may choose.",
    )
    # Acceptance alarm (speculative.accept_alarm): the draft falls behind a weight update
    speculative_on_collapse: str = _opt(
        "warn",
        "When the accept length under new weights falls below --speculative-collapse-threshold x "
        "the best of earlier weights: warn (a warning, spec_accept_alarm in outputs), or disable "
        "(also decode without speculation until the next weight update; same outputs).",
        choices=ON_COLLAPSE_CHOICES,
    )
    speculative_collapse_threshold: float = _opt(
        0.5, "The acceptance alarm's fraction of the best accept length, in (0, 1)."
    )
    speculative_collapse_min_verify_steps: int = _opt(
        64, "Verify steps new weights take before their accept length is judged (noise guard)."
    )
    # Kernels
    attention_backend: Optional[str] = _opt(
        None,
        "Attention kernels (auto: flashinfer on CUDA when installed, for bfloat16/float16 and "
        "head_dim 64/128/256; else torch_native). torch_native runs everywhere; its CUDA graphs "
        "are captured per power-of-two key width on first use, so prefer flashinfer for long "
        "contexts on GPUs. SGLang's other backends (fa3, triton, ...) are accepted and run on "
        "the auto choice; a backend that cannot run here falls back, and the log says which and "
        "why.",
        choices=ATTENTION_BACKENDS + SGLANG_ATTENTION_BACKENDS,
    )
    # CUDA graphs and padding (without CUDA the same sizes and padding run eagerly)
    cuda_graph_bs: Optional[list[int]] = _opt(
        None,
        "Batch sizes to capture, any list (deduplicated and sorted; sizes above "
        "--max-running-requests are dropped). A batch runs as the smallest size >= its own, "
        "padded.",
        unset="1..8, then steps of 2 to 32, 4 to 64, 8 to 256, 16 beyond, up to "
        "--cuda-graph-max-bs",
    )
    cuda_graph_max_bs: Optional[int] = _opt(
        None,
        "Largest size of the default capture list (auto: min(--max-running-requests, 256)); larger "
        "batches run eagerly.",
    )
    disable_cuda_graph: bool = _opt(
        False, "No CUDA graphs and no padding: every batch runs eagerly at its own size."
    )
    disable_cuda_graph_padding: bool = _opt(
        False,
        "Replay only batches whose size is in the capture list (speculative modes included); "
        "others run eagerly.",
    )
    disable_draft_cuda_graph: bool = _opt(
        False,
        "Run the speculative draft stage (draft steps and draft extend) eagerly; the target still "
        "uses graphs.",
    )
    cuda_graph_self_check: bool = _opt(
        False,
        "At startup, run every captured size with a padded batch and compare with eager; refuse to "
        "start on a mismatch, naming the size and mode.",
    )
    # Tensor parallelism (SGLang's flags)
    tp_size: int = _opt(
        1,
        "Tensor-parallel ranks of the engine: this process is rank 0 and starts the others (on "
        "CUDA one GPU each from --base-gpu-id; on the CPU, processes sharing this host). Llama, "
        "Qwen2, Qwen3, MiMo, GLM-4.5 and DeepSeek-V3 targets without speculative decoding.",
        aliases=("tensor-parallel-size",),
    )
    ep_size: int = _opt(
        1,
        "Expert parallelism of a MoE target's routed experts (a divisor of --tp-size): the "
        "experts split into --ep-size groups, each held by --tp-size / --ep-size ranks that "
        "split its features (SGLang's moe_tp_size); at 1 every rank holds every expert's block "
        "of features, at --tp-size each rank holds num_experts / tp_size whole experts (the "
        "router and shared experts placed as at 1).",
        aliases=("expert-parallel-size",),
    )
    dist_init_addr: Optional[str] = _opt(
        None,
        "HOST:PORT where rank 0 serves the ranks' rendezvous store (the same on every node; "
        "required at --nnodes > 1).",
        unset="a free port on 127.0.0.1",
    )
    nnodes: int = _opt(
        1,
        "Machines the engine's --tp-size ranks span, --tp-size / --nnodes on each (a divisor "
        "of --tp-size); node 0 holds rank 0 and serves, the others run "
        "`launch_server --node-rank R`.",
    )
    node_rank: int = _opt(
        0,
        "This machine's node (0..--nnodes - 1): it runs global ranks node_rank * tp_size / "
        "nnodes onwards; at > 0 it serves nothing and exits when rank 0 stops the engine.",
    )
    base_gpu_id: int = _opt(
        0,
        "On CUDA, the GPU of rank 0 (of the only rank at --tp-size 1); rank r runs on "
        "base_gpu_id + r.",
    )
    dist_timeout: Optional[int] = _opt(
        None, "Seconds a collective between the ranks may wait (auto: torch's 1800)."
    )
    debug_tp_check_tokens: bool = _opt(
        False,
        "At --tp-size > 1, compare every rank's sampled tokens after each step and fail the "
        "requests in flight, naming the request and ranks, when they differ (one gather per "
        "step). specrl's flag; SGLang's SYNC_TOKEN_IDS_ACROSS_TP instead makes them agree.",
    )
    # Weights
    weight_version: str = _opt(
        "default", "Version label of the loaded weights, reported in every response's meta_info."
    )
    # Logging and metrics
    log_level: str = _opt("info", "Logging level.", choices=LOG_LEVELS)
    log_requests: bool = _opt(
        False, "Log one line per finished request (rid, token counts, finish reason, latency)."
    )
    enable_metrics: bool = _opt(
        False, "Serve Prometheus metrics at GET /metrics (SGLang's sglang:* names)."
    )
    enable_nan_detection: bool = _opt(
        False,
        "Check the logits of every step for NaN: log a warning and sample as if those logits "
        "were -1e5 (SGLang's behaviour).",
    )
    grammar_backend: str = _opt(
        "xgrammar",
        "What compiles the regex / json_schema / ebnf of constrained requests: xgrammar "
        "(SGLang's default), or none to refuse them with a 400 (outlines and llguidance are "
        "refused at launch).",
        choices=GRAMMAR_BACKENDS,
    )
    constrained_json_disable_any_whitespace: bool = _opt(
        False,
        "JSON schemas allow no whitespace beyond one space after ',' and ':' (SGLang's flag; by "
        "default any amount is allowed).",
    )
    enable_custom_logit_processor: bool = _opt(
        False,
        "Let requests carry a custom logit processor (SGLang's CustomLogitProcessor.to_str()): "
        "this runs the client's Python code inside the engine, so enable it only for trusted "
        "clients.",
    )
    enable_return_routed_experts: bool = _opt(
        False,
        "MoE models: record each token's top-k experts per layer, so requests may ask for them "
        "(return_routed_experts; slime's --use-rollout-routing-replay).",
    )
    # SGLang flags without a specrl option, given a value other than SGLang's default
    # (spec_engine.args.sglang_compat: logged as no-ops, or refused).
    sglang_options: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})

    def __post_init__(self) -> None:
        self.dtype = normalize_dtype(self.dtype)
        check_engine_args(self)
        self.speculative_algorithm = canonical_algorithm(self.speculative_algorithm)
        check_speculative(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- CLI generation


def add_cli_args(
    parser: argparse.ArgumentParser,
    prefix: str = "",
    exclude: typing.Iterable[str] = (),
    required: typing.Iterable[str] = (),
) -> None:
    """Add one flag per EngineArgs field: `--{prefix}{name-with-dashes}` (underscores also
    accepted); `required`: fields the command line must give (a server's --model-path)."""
    add_dataclass_args(
        parser,
        EngineArgs,
        f"engine options ({'--' + prefix + '*' if prefix else 'EngineArgs'})",
        prefix,
        exclude,
        required,
    )
    add_dataclass_args(
        parser,
        CompatArgs,
        "SGLang flags without a specrl option (accepted so SGLang command lines run unchanged)",
        prefix,
        exclude,
    )


def from_cli_args(namespace: argparse.Namespace, prefix: str = "", **overrides: Any) -> EngineArgs:
    """Build EngineArgs from parsed flags; `overrides` (launcher-owned values) win."""
    options = overrides.setdefault("sglang_options", given_options(namespace, prefix))
    check_sglang_options(options, flag_prefix=prefix)  # errors name the flag as typed
    return dataclass_from_args(EngineArgs, namespace, prefix, **overrides)


def field_names() -> list[str]:
    """Every engine option a command line can give: EngineArgs' and SGLang's compat flags."""
    own = [f.name for f in dataclasses.fields(EngineArgs) if f.metadata.get("cli", True)]
    return own + list(SGLANG_FLAGS)


def split_sglang_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """EngineArgs keyword arguments with SGLang-only names (`tp_size=1`) moved into
    `sglang_options`, so `Engine(model_path=..., tp_size=1)` works as in SGLang."""
    compat = {k: v for k, v in kwargs.items() if k in SGLANG_FLAGS}
    if not compat:
        return kwargs
    own = {k: v for k, v in kwargs.items() if k not in SGLANG_FLAGS}
    own["sglang_options"] = {**kwargs.get("sglang_options", {}), **compat}
    return own


def closest_field(name: str) -> Optional[str]:
    """The EngineArgs field most like `name`, for 'did you mean' messages."""
    matches = difflib.get_close_matches(name.replace("-", "_"), field_names(), n=1, cutoff=0.5)
    return matches[0] if matches else None
