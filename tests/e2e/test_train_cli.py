"""--help of scripts/train.py and spec_engine.launch_server: each flag once, defaults shown,
required flags marked; the underscore spellings still parse."""

from __future__ import annotations

import re

import pytest

from spec_engine.launch_server import build_parser as server_parser
from specrl.train_options import build_parser, parse_args

REQUIRED = [
    "--hf-checkpoint",
    "M",
    "--rollout-batch-size",
    "2",
    "--num-rollout",
    "1",
    "--output-dir",
    "o",
]


def entries(help_text: str) -> dict[str, str]:
    """Each listed flag's help entry (its lines joined), by the flag's first spelling."""
    found: dict[str, str] = {}
    flag = None
    for line in help_text.splitlines():
        match = re.match(r"  (-[-\w]+)", line)
        if match:
            flag = match.group(1)
            assert flag not in found, f"{flag} is listed twice"
            found[flag] = line
        elif flag is not None and line.startswith("    "):
            found[flag] += " " + line.strip()
        else:
            flag = None
    return {k: re.sub(r"\s+", " ", v) for k, v in found.items()}


def test_train_help_lists_each_flag_once_with_defaults_and_required_flags():
    parser = build_parser()
    help_text = parser.format_help()
    listed = entries(help_text)
    # Every flag, once, under its first spelling (the dashed one; -h for help).
    assert set(listed) == {a.option_strings[0] for a in parser._actions}
    assert not [flag for flag in listed if "_" in flag]
    assert "(default: 0.2)" in listed["--eps-clip"]
    assert "(default: 1024)" in listed["--rollout-max-response-len"]
    assert "(default: 16384)" in listed["--sglang-max-prefill-tokens"]
    assert "(default: 1)" in listed["--rollout-num-gpus"]
    assert "default" not in listed["--colocate"]  # a switch is off unless given
    for flag in ("--hf-checkpoint", "--rollout-batch-size", "--num-rollout", "--output-dir"):
        assert listed[flag].endswith("(required)"), listed[flag]
        assert flag in help_text.splitlines()[0]  # and in the usage line
    headings = [line for line in help_text.splitlines() if re.match(r"\S.*:$", line)]
    assert headings[1:] == [
        "trainer (TrainerArgs):",
        "trainer: policy loss (LossConfig):",
        "trainer: weight sync (WeightSyncConfig):",
        "rollout options (RolloutArgs):",
        "engine options (--sglang-*):",
        "SGLang flags without a specrl option (accepted so SGLang command lines run unchanged):",
        "launcher:",
        "slime / Megatron-LM flags for run scripts (no-ops or refused):",
    ]


def test_underscore_spellings_still_parse():
    args = parse_args(
        [
            "--hf_checkpoint",
            "M",
            "--rollout_batch_size",
            "2",
            "--num_rollout",
            "1",
            "--output_dir",
            "o",
            "--eps_clip",
            "0.3",
            "--sglang_max_total_tokens",
            "64",
        ]
    )
    assert args.options.loss.eps_clip == 0.3 and args.options.engine.max_total_tokens == 64
    assert args.num_rollout == 1 and args.options.trainer.hf_checkpoint == "M"


def test_sglang_prefixes_and_compat_flags_as_slime_passes_them():
    """A unique prefix of an engine flag is that flag (argparse, as SGLang's own parser); SGLang
    flags without a specrl option are kept for the engine to log or refuse."""
    args = parse_args(
        [
            *REQUIRED,
            "--sglang-mem-fraction",
            "0.5",
            "--sglang-enable-torch-compile",
            "--sglang-attention-backend",
            "fa3",
        ]
    )
    engine = args.options.engine
    assert engine.mem_fraction_static == 0.5 and engine.attention_backend == "fa3"
    assert engine.sglang_options == {"enable_torch_compile": True}
    fp8 = parse_args([*REQUIRED, "--sglang-quantization", "fp8"]).options.engine
    assert fp8.quantization == "fp8" and fp8.sglang_options == {}
    with pytest.raises(SystemExit, match="quantization 'awq' is not supported.*quantization fp8"):
        parse_args([*REQUIRED, "--sglang-quantization", "awq"])


def test_train_refuses_a_missing_required_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(REQUIRED[2:])
    assert "--hf-checkpoint" in capsys.readouterr().err


def test_launch_server_help_marks_model_path_required(capsys):
    parser = server_parser()
    listed = entries(parser.format_help())
    assert listed["--model-path"].endswith("(required)")
    assert "(default: 30000)" in listed["--port"]
    assert "--model-path" in parser.format_usage()
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "30001"])
    assert "--model-path" in capsys.readouterr().err
    assert parser.parse_args(["--model_path", "/m"]).model_path == "/m"


# How a flag's help says what it is when not given.
SHOWS_DEFAULT = re.compile(r"\(default: |auto: |\(required\)")


@pytest.mark.parametrize("make_parser", [build_parser, server_parser], ids=["train", "server"])
def test_every_flag_that_takes_a_value_shows_its_default(make_parser):
    """--help of scripts/train.py and launch_server: each flag that takes a value ends its help
    with (default: X), gives an auto: ... rule, or is (required); a switch shows none (off
    unless given). SGLang's and slime's compat flags included (their default is the value that
    is accepted without a word)."""
    parser = make_parser()
    switches = {a.option_strings[0] for a in parser._actions if a.nargs == 0}
    listed = entries(parser.format_help())
    silent = [
        f for f, text in listed.items() if f not in switches and not SHOWS_DEFAULT.search(text)
    ]
    assert silent == []
