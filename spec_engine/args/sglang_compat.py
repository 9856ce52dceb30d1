"""SGLang server flags the engine has no option for: each is accepted and its reason logged once
(a no-op here), or refused when given a value other than SGLang's default, naming why and what
to use instead. None of SGLang's flags is an "unrecognized argument".

The table is the single source: `CompatArgs` (a dataclass generated from it) gives the CLI
flags, `check_sglang_options` sorts given values into refusals and log lines, and
docs/sglang_compat.md is checked against it by tests/server/test_cli_compat.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class SGLangFlag:
    default: Any
    reason: str  # why the engine does nothing with it, or why a non-default value is refused
    refuse: bool = False  # a value other than `default` is an error
    type: Any = str  # the value's type when `default` is None

    @property
    def value_type(self) -> Any:
        return self.type if self.default is None else type(self.default)


def _noop(default: Any, reason: str, type: Any = str) -> SGLangFlag:
    return SGLangFlag(default, reason, False, type)


def _refuse(default: Any, reason: str, type: Any = str) -> SGLangFlag:
    return SGLangFlag(default, reason, True, type)


_NO_HUB = "specrl loads local checkpoint directories only (no model hub downloads)"
_ONE_DEVICE = (
    "an engine runs its ranks by tensor parallelism only (--tp-size); for more throughput run "
    "more engines (scripts/train.py --rollout-num-gpus, or several servers behind a router)"
)
_NO_MOE = (
    "specrl's MoE layers (GLM-4.5, DeepSeek-V3) run their experts unfused, split by features "
    "(--ep-size 1) or whole per rank (--ep-size equal to --tp-size): no DeepEP, all-to-all or "
    "fused MoE backends"
)
_TORCH_COLLECTIVES = (
    "tensor-parallel collectives are torch.distributed's (NCCL on CUDA, gloo on the CPU); no "
    "custom all-reduce or peer-to-peer copies"
)
_NO_MLA = (
    "specrl runs MLA (DeepSeek-V3) one way: absorbed, over the latent KV cache, with "
    "torch_native attention (no FlashInfer or FlashMLA MLA kernels)"
)
_NO_TRITON = "specrl has no Triton attention kernels (see --attention-backend)"
_NO_COMPILE = (
    "specrl does not torch.compile its models; its CUDA graphs (--cuda-graph-bs, "
    "--cuda-graph-max-bs) already remove the launch overhead torch.compile targets"
)
_NO_OUTLINES = "outlines only; specrl compiles grammars with xgrammar (--grammar-backend)"
_NO_LORA = "specrl serves no LoRA adapters; merge the adapter into the checkpoint"
_NO_DISAGG = "specrl has no prefill/decode disaggregation"
_NO_DEBUG_DUMP = "specrl has no tensor dump hooks"
_NO_HICACHE = "specrl's prefix cache lives in device memory only (no hierarchical cache)"

SGLANG_FLAGS: dict[str, SGLangFlag] = {
    # Model loading
    "tokenizer_mode": _refuse(
        "auto", "specrl loads the fast tokenizer (transformers AutoTokenizer); only auto"
    ),
    "load_format": _refuse(
        "auto",
        "specrl reads safetensors and pytorch_model.bin checkpoints and picks by the files "
        "present; only auto, safetensors or pt",
    ),
    "trust_remote_code": _noop(
        False,
        "specrl runs only its own model classes (Llama, Qwen2, Qwen3, MiMo, GLM-4.5 MoE); no "
        "checkpoint code is executed",
    ),
    "revision": _refuse(None, _NO_HUB + "; check out the revision yourself and pass its path"),
    "download_dir": _noop(None, _NO_HUB),
    "kv_cache_dtype": _refuse(
        "auto", "the KV cache has the model's dtype (--dtype); fp8 KV caches are not implemented"
    ),
    "quantization_param_path": _refuse(
        None, "specrl reads no KV-cache scales (the KV cache has the model's dtype)"
    ),
    "json_model_override_args": _refuse(
        "{}", "edit the checkpoint's config.json instead (the trainer reads the same file)"
    ),
    "is_embedding": _refuse(False, "specrl serves generative models only"),
    "completion_template": _refuse(
        None, "code-completion templates are not implemented; send the formatted prompt as text"
    ),
    "cpu_offload_gb": _refuse(0, "weights stay on the device; lower --mem-fraction-static", int),
    "delete_ckpt_after_loading": _refuse(
        False,
        "specrl never deletes checkpoints (the trainer and --update-weights-from-disk read them)",
    ),
    "enable_memory_saver": _noop(
        False,
        "release_memory_occupation / resume_memory_occupation free and restore weights, KV cache "
        "and CUDA graphs without it",
    ),
    "enable_draft_weights_cpu_backup": _noop(
        False, "draft weights are kept across release_memory_occupation without it"
    ),
    # Parallelism
    "dp_size": _refuse(1, _ONE_DEVICE, int),
    "pp_size": _refuse(1, _ONE_DEVICE, int),
    "gpu_id_step": _refuse(1, "rank r runs on GPU --base-gpu-id + r", int),
    "load_balance_method": _noop("round_robin", "one engine per server: nothing to balance"),
    "enable_dp_attention": _refuse(False, _ONE_DEVICE),
    "enable_dp_lm_head": _refuse(False, _ONE_DEVICE),
    "enable_ep_moe": _refuse(False, _NO_MOE),
    "enable_deepep_moe": _refuse(False, _NO_MOE),
    "deepep_mode": _noop("auto", _NO_MOE),
    "moe_runner_backend": _noop("auto", _NO_MOE),
    "speculative_moe_runner_backend": _noop(None, _NO_MOE),
    "n_share_experts_fusion": _noop(0, _NO_MOE, int),
    "disable_shared_experts_fusion": _noop(False, _NO_MOE),
    "enable_nccl_nvls": _noop(False, _TORCH_COLLECTIVES),
    "disable_custom_all_reduce": _noop(False, _TORCH_COLLECTIVES),
    "enable_p2p_check": _noop(False, _TORCH_COLLECTIVES),
    # Kernels and compilation
    "enable_torch_compile": _noop(False, _NO_COMPILE),
    "torch_compile_max_bs": _noop(32, _NO_COMPILE, int),
    "torchao_config": _refuse("", "specrl quantizes to block FP8 only (--quantization fp8)"),
    "sampling_backend": _noop(
        None, "specrl samples with its own torch sampler (exact, seeded per request)"
    ),
    "constrained_json_whitespace_pattern": _noop(None, _NO_OUTLINES),
    "disable_outlines_disk_cache": _noop(False, _NO_OUTLINES),
    "speculative_attention_mode": _noop(
        "prefill",
        "the verify forward always runs the target's own backend with a tree mask (SGLang's "
        "prefill mode)",
    ),
    "speculative_draft_attention_backend": _noop(
        None, "the draft runs on the target's attention backend (--attention-backend)"
    ),
    "prefill_attention_backend": _noop(
        None, "prefill and decode share --attention-backend in specrl"
    ),
    "decode_attention_backend": _noop(
        None, "prefill and decode share --attention-backend in specrl"
    ),
    "speculative_draft_model_revision": _refuse(
        None, _NO_HUB + "; pass the draft's local directory as --speculative-draft-model-path"
    ),
    "speculative_draft_model_quantization": _refuse(
        None, "the draft runs unquantized in the target's dtype", str
    ),
    "triton_attention_reduce_in_fp32": _noop(False, _NO_TRITON),
    "triton_attention_num_kv_splits": _noop(8, _NO_TRITON, int),
    "disable_mla": _noop(False, _NO_MLA),
    "enable_flashinfer_mla": _noop(False, _NO_MLA),
    "enable_flashmla": _noop(False, _NO_MLA),
    "flashinfer_mla_disable_ragged": _noop(False, _NO_MLA),
    "enable_double_sparsity": _refuse(False, "double-sparsity attention is not implemented"),
    "ds_channel_config_path": _noop(None, "double-sparsity attention is not implemented"),
    "ds_heavy_channel_num": _noop(32, "double-sparsity attention is not implemented", int),
    "ds_heavy_token_num": _noop(256, "double-sparsity attention is not implemented", int),
    "ds_heavy_channel_type": _noop("qk", "double-sparsity attention is not implemented"),
    "ds_sparse_decode_threshold": _noop(4096, "double-sparsity attention is not implemented", int),
    "enable_llama4_multimodal": _noop(None, "specrl serves text-only models", bool),
    "disable_fast_image_processor": _noop(False, "specrl serves text-only models"),
    # Scheduling
    "enable_mixed_chunk": _noop(
        False, "prefill chunks and decode steps run as separate forwards in specrl"
    ),
    "num_continuous_decode_steps": _refuse(
        1, "the scheduler checks for new requests after every decode step", int
    ),
    "stream_output": _refuse(
        False, "SGLang's older name of --incremental-streaming-output; use that flag"
    ),
    "tokenizer_worker_num": _refuse(
        1,
        "a specrl server tokenizes with one tokenizer in its own process (long prompts off the "
        "event loop); for more tokenizing throughput run more servers behind a router",
        int,
    ),
    "allow_auto_truncate": _refuse(
        False, "a prompt longer than the context is refused with a 400; shorten it client-side"
    ),
    "enable_hierarchical_cache": _refuse(False, _NO_HICACHE),
    "hicache_ratio": _noop(2.0, _NO_HICACHE),
    "warmups": _noop(None, "the server runs one warmup request (--skip-server-warmup skips it)"),
    "watchdog_timeout": _noop(
        300.0,
        "a request that fails in the scheduler is reported to its caller with the error; no "
        "watchdog kills the process",
    ),
    # Features outside the engine
    "lora_paths": _refuse(None, _NO_LORA, list[str]),
    "max_loras_per_batch": _noop(8, _NO_LORA, int),
    "lora_backend": _noop("triton", _NO_LORA),
    "reasoning_parser": _refuse(None, "reasoning-content parsing is not implemented"),
    "tool_call_parser": _refuse(None, "tool-call parsing is not implemented"),
    "disaggregation_mode": _refuse("null", _NO_DISAGG),
    "disaggregation_bootstrap_port": _noop(8998, _NO_DISAGG, int),
    "disaggregation_transfer_backend": _noop("mooncake", _NO_DISAGG),
    "debug_tensor_dump_output_folder": _noop(None, _NO_DEBUG_DUMP),
    "debug_tensor_dump_input_file": _noop(None, _NO_DEBUG_DUMP),
    "debug_tensor_dump_inject": _noop(False, _NO_DEBUG_DUMP),
    # Logging
    "log_level_http": _noop(None, "the HTTP server logs at --log-level"),
    "log_requests_level": _noop(0, "--log-requests logs one line per finished request", int),
    "show_time_cost": _noop(False, "per-stage speculative timings are in get_server_info"),
    "decode_log_interval": _noop(
        40, "throughput is reported by /metrics and get_server_info, not in the log", int
    ),
    "file_storage_path": _noop("sglang_storage", "specrl stores no files for requests"),
    "enable_cache_report": _noop(
        False, "meta_info.cached_tokens is always reported; OpenAI usage has no cache details"
    ),
}

# SGLang's spelling of a value that means the default (load_format "safetensors" reads what auto
# reads here).
_EQUIVALENT = {"load_format": {"safetensors", "pt"}}

CompatArgs = dataclasses.make_dataclass(
    "CompatArgs",
    [
        (
            name,
            Optional[flag.value_type],
            dataclasses.field(
                default=flag.default,
                metadata={
                    "help": ("[refused unless the default] " if flag.refuse else "[no-op] ")
                    + flag.reason
                    + ".",
                    "unset": "none",  # SGLang's None
                },
            ),
        )
        for name, flag in SGLANG_FLAGS.items()
    ],
    frozen=True,
)
CompatArgs.__doc__ = "SGLang flags kept for drop-in command lines (see SGLANG_FLAGS)."


def check_sglang_options(options: dict[str, Any], flag_prefix: str = "") -> list[str]:
    """Refuse what cannot be honoured (ValueError naming the flag, why, and what to use);
    return one log line per accepted no-op."""
    lines = []
    for name, value in options.items():
        flag = SGLANG_FLAGS.get(name)
        cli = f"--{flag_prefix}{name.replace('_', '-')}"
        if flag is None:
            raise ValueError(f"unknown SGLang option {cli}")
        if value == flag.default or value in _EQUIVALENT.get(name, ()):
            continue
        if flag.refuse:
            raise ValueError(f"{cli} {value!r} is not supported: {flag.reason}")
        lines.append(f"{cli} {value!r} has no effect in specrl: {flag.reason}")
    return lines


def given_options(namespace: Any, prefix: str = "") -> dict[str, Any]:
    """The compat flags parsed into `namespace` whose value is not SGLang's default."""
    out = {}
    for name, flag in SGLANG_FLAGS.items():
        value = getattr(namespace, f"{prefix.replace('-', '_')}{name}", flag.default)
        if value != flag.default:
            out[name] = value
    return out
