"""EngineArgs: CLI generated from the dataclass, validation messages, auto resolution."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re

import pytest

from spec_engine.args.engine_args import EngineArgs, add_cli_args, closest_field, from_cli_args
from spec_engine.args.resolve import resolve_auto
from spec_engine.launch_server import build_parser
from spec_engine.models.hf_config import ModelConfig


def parse(argv: list[str], prefix: str = "") -> EngineArgs:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_cli_args(parser, prefix=prefix)
    return from_cli_args(parser.parse_args(argv), prefix=prefix)


def test_every_field_has_a_flag_with_help():
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(EngineArgs):
        if f.name == "sglang_options":  # filled from the SGLang compat flags
            continue
        assert f.name in flags, f.name
        assert flags[f.name].help, f"--{f.name} has no help text"


def test_flags_round_trip_with_sglang_names():
    args = parse(
        [
            "--model-path",
            "/m",
            "--max-running-requests",
            "8",
            "--disable-radix-cache",
            "--page-size",
            "4",
            "--chunked-prefill-size",
            "-1",
            "--dtype",
            "bf16",
            "--random_seed",
            "3",
        ]
    )
    assert args.model_path == "/m" and args.max_running_requests == 8 and args.disable_radix_cache
    assert args.page_size == 4 and args.chunked_prefill_size == -1 and args.dtype == "bfloat16"
    assert args.random_seed == 3


def test_prefixed_flags_for_launchers():
    args = parse(
        ["--sglang-model-path", "/m", "--sglang-max-total-tokens", "100"], prefix="sglang-"
    )
    assert args.model_path == "/m" and args.max_total_tokens == 100
    with pytest.raises(SystemExit):
        parse(["--model-path", "/m"], prefix="sglang-")


def test_abbreviations_and_model_alias_as_in_sglang(capsys):
    """SGLang's parser takes unique prefixes (the seeds' --mem-fraction 0.6) and --model."""
    args = from_cli_args(
        build_parser().parse_args(["--model", "/m", "--mem-fraction", "0.6", "--max-running", "4"])
    )
    assert (args.model_path, args.mem_fraction_static, args.max_running_requests) == ("/m", 0.6, 4)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "/m", "--speculative-num", "3"])
    assert "ambiguous option: --speculative-num could match" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(page_size=0), "--page-size"),
        (dict(max_running_requests=-1), "--max-running-requests"),
        (dict(chunked_prefill_size=0), "--chunked-prefill-size"),
        (dict(mem_fraction_static=1.5), "--mem-fraction-static"),
        (dict(dtype="int8"), "--dtype"),
        (dict(attention_backend="fa2"), "--attention-backend"),
        (dict(device="tpu"), "--device"),
        (dict(port=0), "--port"),
    ],
)
def test_invalid_values_name_the_flag(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EngineArgs(model_path="/m", **kwargs)


def test_resolve_auto_on_cpu():
    args = resolve_auto(
        EngineArgs(model_path="/m"), cuda_available=False, checkpoint_dtype="bfloat16"
    )
    assert (
        args.device == "cpu"
        and args.dtype == "float32"
        and args.attention_backend == "torch_native"
    )
    assert (
        args.chunked_prefill_size == 2048
        and args.tokenizer_path == "/m"
        and isinstance(args.random_seed, int)
    )
    cuda = resolve_auto(
        EngineArgs(model_path="/m"), cuda_available=True, checkpoint_dtype="float32"
    )
    assert cuda.device == "cuda" and cuda.dtype == "bfloat16" and cuda.chunked_prefill_size == 8192
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_auto(
            EngineArgs(model_path="/m", device="cuda"), cuda_available=False, checkpoint_dtype=None
        )
    with pytest.raises(ValueError, match="multiple of --page-size"):
        resolve_auto(
            EngineArgs(model_path="/m", page_size=16, chunked_prefill_size=100),
            cuda_available=False,
            checkpoint_dtype=None,
        )


@pytest.mark.parametrize(
    "given, want",
    [
        ({}, True),  # SGLang's default
        ({"disable_overlap_schedule": True}, False),
        ({"enable_overlap_schedule": True, "disable_overlap_schedule": True}, False),
        ({"speculative_algorithm": "NGRAM"}, False),  # speculative steps do not overlap yet
        ({"speculative_algorithm": "NGRAM", "enable_overlap_schedule": True}, True),
    ],
)
def test_overlap_schedule_resolves_on_for_plain_decoding(caplog, given, want):
    """The overlap flags as the engine runs them: on unless disabled; auto is off with
    speculation, silently (an explicit --enable-overlap-schedule is kept)."""
    with caplog.at_level(logging.DEBUG):
        args = resolve_auto(
            EngineArgs(model_path="/m", **given), cuda_available=False, checkpoint_dtype=None
        )
    assert (args.enable_overlap_schedule, args.disable_overlap_schedule) == (want, not want)
    assert not caplog.records


def test_attention_backend_choice(monkeypatch, caplog):
    """auto: FlashInfer on CUDA when installed and it has kernels for the head size; an explicit
    flashinfer that cannot run falls back to torch_native, with one log line saying why."""
    from spec_engine.args import resolve as config

    def resolve(installed, **kw):
        monkeypatch.setattr(config, "flashinfer_installed", lambda: installed)
        return resolve_auto(
            EngineArgs(model_path="/m", **kw.pop("args", {})), checkpoint_dtype=None, **kw
        )

    assert resolve(True, cuda_available=True, head_dim=128).attention_backend == "flashinfer"
    assert (
        resolve(
            True, cuda_available=True, head_dim=128, args=dict(dtype="float32")
        ).attention_backend
        == "torch_native"
    )
    assert resolve(True, cuda_available=True, head_dim=16).attention_backend == "torch_native"
    assert resolve(False, cuda_available=True, head_dim=128).attention_backend == "torch_native"
    assert resolve(True, cuda_available=False, head_dim=128).attention_backend == "torch_native"
    for installed, cuda, head_dim, dtype, why in (
        (True, False, 128, "bfloat16", "no CUDA device"),
        (False, True, 128, "bfloat16", r"specrl\[gpu\]"),
        (True, True, 16, "bfloat16", "no kernels for head_dim 16"),
        (True, True, 128, "float32", "no float32 kernels"),
    ):
        with caplog.at_level("WARNING", logger="spec_engine.args.resolve"):
            caplog.clear()
            chosen = resolve(
                installed,
                cuda_available=cuda,
                head_dim=head_dim,
                args=dict(attention_backend="flashinfer", dtype=dtype),
            )
        assert chosen.attention_backend == "torch_native"
        (line,) = [r.getMessage() for r in caplog.records]
        assert re.search(f"flashinfer cannot run here.*{why}.*using torch_native", line), line
    # SGLang's other backends run on what specrl has, saying so in one line.
    for installed, cuda, expected in ((True, True, "flashinfer"), (True, False, "torch_native")):
        with caplog.at_level("WARNING", logger="spec_engine.args.resolve"):
            caplog.clear()
            chosen = resolve(
                installed, cuda_available=cuda, head_dim=128, args=dict(attention_backend="fa3")
            )
        assert chosen.attention_backend == expected
        (line,) = [r.getMessage() for r in caplog.records]
        assert f"specrl has no fa3 kernels; using {expected}" in line


def test_closest_field_suggestion():
    assert closest_field("max-runing-requests") == "max_running_requests"
    assert closest_field("zzzz") is None


def test_model_config_reads_both_rope_layouts():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    old = ModelConfig.from_dict(
        {
            **base,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    new = ModelConfig.from_dict(
        {
            **base,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert old.rope_theta == new.rope_theta == 500000.0 and old.rope_scaling == new.rope_scaling
    assert old.num_key_value_heads == 2 and old.head_dim == 4
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_dict({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_dict(
            {**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}
        )


def test_readme_documents_every_engine_flag():
    import pathlib

    readme = (pathlib.Path(__file__).parents[2] / "docs" / "engine.md").read_text()
    missing = [
        f.name
        for f in dataclasses.fields(EngineArgs)
        if f.metadata.get("cli", True) and f"`--{f.name.replace('_', '-')}`" not in readme
    ]
    assert not missing, f"docs/engine.md's engine flag table lacks {missing}"
