"""What EngineArgs accepts without reading a model: each option's choices and range (the
speculative flags that go together: spec_checks). Every error names the flag and the value.
"""

from __future__ import annotations

from typing import Any, Optional

from spec_engine.args.sglang_compat import check_sglang_options

DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
DTYPE_SPELLINGS = {
    "half": "float16",
    "fp16": "float16",
    "float": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
}
DEVICE_CHOICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("torch_native", "flashinfer")
# SGLang's other backends: accepted, and run on one of specrl's (resolve logs which and why).
SGLANG_ATTENTION_BACKENDS = (
    "fa3",
    "fa4",
    "triton",
    "flex_attention",
    "flashmla",
    "cutlass_mla",
    "trtllm_mha",
    "trtllm_mla",
    "aiter",
    "wave",
    "intel_amx",
    "intel_xpu",
    "ascend",
    "dual_chunk_flash_attn",
    "hybrid_linear_attn",
    "nsa",
)
SCHEDULE_POLICIES = ("fcfs", "random")  # SGLang's cache-agnostic ones
LOG_LEVELS = ("debug", "info", "warning", "error")
# SGLang's --grammar-backend choices; specrl compiles with xgrammar (SGLang's default) or none.
GRAMMAR_BACKENDS = ("xgrammar", "outlines", "llguidance", "none")
ON_COLLAPSE_CHOICES = ("warn", "disable")  # spec_engine.speculative.accept_alarm's modes
# Options that must be positive integers when given (None: auto).
POSITIVE_OR_AUTO = ("context_length", "max_total_tokens", "max_running_requests")
POSITIVE = (
    "max_prefill_tokens",
    "page_size",
    "stream_interval",
    "max_request_bytes",
    "max_request_prompts",
    "max_request_samples",
    "max_request_tokens",
    "speculative_collapse_min_verify_steps",
)


def normalize_dtype(dtype: str) -> str:
    """SGLang's other spellings of a dtype (half, bf16, ...) as torch names them."""
    return DTYPE_SPELLINGS.get(dtype, dtype)


def check_engine_args(args: Any) -> None:
    """Every EngineArgs option but the speculative ones, in its choices and range."""
    check_choices(args)
    check_sglang_options(args.sglang_options)
    check_sizes(args)
    for name in ("mem_fraction_static", "speculative_collapse_threshold"):
        value = getattr(args, name)
        if value is not None and not 0.0 < value < 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in (0, 1), got {value}")
    if args.schedule_conservativeness <= 0:
        raise ValueError(
            f"--schedule-conservativeness must be positive, got {args.schedule_conservativeness}"
        )
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    check_parallelism(args)


def check_parallelism(args: Any) -> None:
    """--tp-size and its rendezvous flags (what the model allows: args.tp_checks)."""
    check_positive("tp_size", args.tp_size)
    check_positive("dist_timeout", args.dist_timeout, allow_none=True)
    if args.base_gpu_id < 0:
        raise ValueError(f"--base-gpu-id must be >= 0, got {args.base_gpu_id}")
    split_address(args.dist_init_addr)
    check_nodes(args)


def check_nodes(args: Any) -> None:
    """--nnodes and --node-rank (SGLang's): the ranks split evenly over the nodes, which meet
    at --dist-init-addr."""
    check_positive("nnodes", args.nnodes)
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(
            f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), got "
            f"{args.node_rank}"
        )
    if args.nnodes == 1:
        return
    if args.tp_size % args.nnodes:
        raise ValueError(
            f"--tp-size {args.tp_size} is not divisible by --nnodes {args.nnodes}: every node "
            "runs --tp-size / --nnodes ranks; pick a --tp-size that is a multiple of --nnodes"
        )
    if args.dist_init_addr is None:
        raise ValueError(
            f"--nnodes {args.nnodes} needs --dist-init-addr HOST:PORT: the address where node 0 "
            "serves the ranks' rendezvous store, reachable from every node and the same on each"
        )


def split_address(addr: Optional[str]) -> tuple[str, int]:
    """SGLang's --dist-init-addr "HOST:PORT" (None: loopback, a free port)."""
    if addr is None:
        return "127.0.0.1", 0
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
    return host, int(port)


def check_choices(args: Any) -> None:
    """Options with a fixed set of values (dtype as normalize_dtype leaves it)."""
    check_choice("dtype", args.dtype, ("auto", "float32", "float16", "bfloat16"))
    check_choice("device", args.device, DEVICE_CHOICES)
    check_choice(
        "attention_backend",
        args.attention_backend,
        ATTENTION_BACKENDS + SGLANG_ATTENTION_BACKENDS,
        allow_none=True,
    )
    check_quantization(args.quantization)
    check_choice("schedule_policy", args.schedule_policy, SCHEDULE_POLICIES)
    check_choice("log_level", args.log_level, LOG_LEVELS)
    check_choice("speculative_on_collapse", args.speculative_on_collapse, ON_COLLAPSE_CHOICES)
    check_choice("grammar_backend", args.grammar_backend, GRAMMAR_BACKENDS)
    if args.grammar_backend in ("outlines", "llguidance"):
        raise ValueError(
            f"--grammar-backend {args.grammar_backend} is not supported: specrl compiles "
            "grammars with xgrammar (SGLang's default; it serves the same regex, json_schema and "
            "ebnf requests); use --grammar-backend xgrammar, or none to refuse grammar requests"
        )


def check_sizes(args: Any) -> None:
    """Token, request and batch counts: positive (or auto where None means auto)."""
    for name in POSITIVE_OR_AUTO:
        check_positive(name, getattr(args, name), allow_none=True)
    for name in POSITIVE:
        check_positive(name, getattr(args, name))
    check_positive("cuda_graph_max_bs", args.cuda_graph_max_bs, allow_none=True)
    for size in args.cuda_graph_bs or ():
        check_positive("cuda_graph_bs", size)
    chunk = args.chunked_prefill_size
    if chunk is not None and chunk != -1 and chunk <= 0:
        raise ValueError(f"--chunked-prefill-size must be positive or -1 (disabled), got {chunk}")


def check_quantization(method: Optional[str]) -> None:
    """--quantization: block FP8 only (SGLang's other methods are refused, naming what to use)."""
    if method is not None and method != "fp8":
        raise ValueError(
            f"--quantization {method!r} is not supported: specrl serves block-FP8 weights only "
            "(--quantization fp8, or a block-FP8 checkpoint such as DeepSeek-V3's release without "
            "the flag); for other methods serve the unquantized BF16 checkpoint"
        )


def check_choice(name: str, value: Any, choices: tuple, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value not in choices:
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{flag} must be one of {', '.join(map(str, choices))}; got {value!r}")


def check_positive(name: str, value: Optional[int], allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
