"""SGLang command lines work unchanged: the seed pages' launch commands (tiny local stand-ins for
the hub models, examples/sglang_seeds), every ServerArgs field printed in the seed logs, SGLang's
prefix abbreviations, its draft-tree limits, published draft formats, and the compat flags that
are logged no-ops or refused with a reason."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from spec_engine.args.engine_args import EngineArgs, from_cli_args
from spec_engine.args.sglang_compat import SGLANG_FLAGS, check_sglang_options
from spec_engine.engine import Engine
from spec_engine.launch_server import build_parser

REPO = Path(__file__).resolve().parents[2]
SEEDS = Path(__file__).resolve().parents[1] / "data" / "sglang_seeds.txt"
PROMPT = "The capital of France is"


def parse(argv: list[str]) -> EngineArgs:
    return from_cli_args(build_parser().parse_args(argv))


@pytest.fixture(scope="module")
def seed_ckpt(tmp_path_factory) -> dict[str, str]:
    spec = importlib.util.spec_from_file_location(
        "seed_checkpoints", REPO / "examples" / "sglang_seeds" / "build_checkpoints.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("sglang-seeds")
    paths = module.build(str(out))
    return {"dir": str(out), **paths}


def seed_commands(ckpt_dir: str) -> list[list[str]]:
    script = (
        f"CKPT={shlex.quote(ckpt_dir)}; source examples/sglang_seeds/commands.sh; "
        'printf "%s\\n" "${SEED_COMMANDS[@]}"'
    )
    out = subprocess.run(
        ["bash", "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    return [shlex.split(line) for line in out.splitlines()]


def test_the_example_holds_every_seed_launch_command():
    """examples/sglang_seeds/commands.sh is the seeds' commands with only the hub names (and the
    module name) replaced."""
    seeds = []
    lines = SEEDS.read_text().splitlines()
    for i, line in enumerate(lines):
        if "sglang.launch_server" in line and "--" in line and not line.startswith("#"):
            cmd = line
            while cmd.rstrip().endswith("\\"):
                i += 1
                cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
            seeds.append(cmd.split("sglang.launch_server", 1)[1].split())
    assert len(seeds) == 12

    def hub_free(argv: list[str]) -> list[str]:
        return [a.rsplit("/", 1)[-1] if "/" in a else a for a in argv]

    ours = seed_commands("CKPT")
    assert sorted(map(hub_free, seeds)) == sorted(map(hub_free, ours))


def test_every_seed_command_serves_generate_losslessly(seed_ckpt):
    """Each command starts an engine that answers /generate; its greedy output equals the same
    target without speculation (lossless), so the context raise, the .bin draft, the FR-Spec
    directory, the padded STANDALONE vocabulary and SGLang's larger trees all work."""
    from fastapi.testclient import TestClient

    from spec_engine.server.http_server import create_app

    plain: dict[tuple[str, str], list[int]] = {}
    for argv in seed_commands(seed_ckpt["dir"]):
        args = dataclasses.replace(
            parse(argv), random_seed=0, skip_server_warmup=True, max_total_tokens=4096
        )
        key = (args.model_path, args.dtype)
        if key not in plain:
            with Engine(model_path=args.model_path, dtype=args.dtype, random_seed=0) as ref:
                plain[key] = ref.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0})[
                    "output_ids"
                ]
        with Engine(args) as engine:
            client = TestClient(create_app(engine))
            resp = client.post(
                "/generate",
                json={"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
            )
        assert resp.status_code == 200, (argv, resp.text)
        out = resp.json()
        assert out["output_ids"] == plain[key], argv
        assert out["meta_info"]["spec_verify_ct"] > 0, argv


def test_seed_logs_server_args_all_parse():
    """Every ServerArgs field printed in the seed logs, at its printed value, is a flag that
    parses (None values are left out, as SGLang prints unset options)."""
    logs = re.findall(r"server_args=ServerArgs\((.*?)\)\n", SEEDS.read_text())
    assert len(logs) == 4
    for log in logs:
        values = eval(f"dict({log})")  # the seeds' own repr of ServerArgs
        argv = []
        for name, value in values.items():
            flag = "--" + name.replace("_", "-")
            if value is None or value is False:
                continue
            argv += [flag] if value is True else [flag, str(value)]
        args = parse(argv)
        assert args.model_path == values["model_path"]
        assert args.speculative_num_draft_tokens == values["speculative_num_draft_tokens"]
        # SGLang's device="cuda" and its ports parse; the options specrl has none for are kept.
        assert args.sglang_options.get("enable_mixed_chunk") is None
        assert args.disable_overlap_schedule is True


def test_compat_flags_are_logged_once_or_refused_with_the_alternative(llama_path, caplog):
    with caplog.at_level(logging.WARNING, logger="spec_engine"):
        with Engine(
            model_path=llama_path,
            enable_torch_compile=True,
            torch_compile_max_bs=2,
            trust_remote_code=True,
            ep_size=1,  # SGLang's default: nothing to say
            skip_server_warmup=True,
        ):
            pass
    lines = [r.getMessage() for r in caplog.records if "has no effect in specrl" in r.getMessage()]
    assert len(lines) == 3 and any("--enable-torch-compile True" in x for x in lines), lines
    for argv, needle in (
        (["--dp-size", "2"], "--dp-size 2 is not supported: an engine runs its ranks by tensor"),
        (["--quantization", "awq"], "specrl serves block-FP8 weights only (--quantization fp8"),
        (["--kv-cache-dtype", "fp8_e5m2"], "fp8 KV caches are not implemented"),
        (["--speculative-draft-model-revision", "main"], "--speculative-draft-model-path"),
        (["--allow-auto-truncate"], "shorten it client-side"),
    ):
        with pytest.raises(ValueError, match=re.escape(needle)):
            parse(["--model", "/m", *argv])
    assert check_sglang_options({"load_format": "safetensors"}) == []


def test_compat_table_is_documented():
    """docs/sglang_compat.md lists every compat flag with its kind."""
    doc = (REPO / "docs" / "sglang_compat.md").read_text()
    for name, flag in SGLANG_FLAGS.items():
        row = re.search(rf"^\| `--{name.replace('_', '-')}` \|([^|]*)\|", doc, re.M)
        assert row, name
        assert ("refused" if flag.refuse else "no-op") in row.group(1), name


def test_tree_limits_are_sglangs(llama_path, caplog):
    """topk x steps may propose topk + (steps - 1) * topk^2 tokens (the seeds' 4/3/16 and 8/5/64);
    with topk 1 the token count follows the steps, with a warning, as in SGLang."""
    from spec_engine.args.resolve import max_draft_tokens

    assert (max_draft_tokens(3, 4), max_draft_tokens(5, 8)) == (37, 265)
    from spec_engine.args.resolve import resolve_speculative
    from spec_engine.models.hf_config import ModelConfig

    target = ModelConfig.from_pretrained(llama_path)
    args = parse(
        [
            "--model",
            llama_path,
            "--speculative-algorithm",
            "STANDALONE",
            "--speculative-draft-model-path",
            llama_path,
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "9",
        ]
    )
    with caplog.at_level(logging.WARNING, logger="spec_engine.args.resolve"):
        resolved = resolve_speculative(args, target, target, 256)
    assert resolved.speculative_num_draft_tokens == 4
    assert "adjusted to --speculative-num-steps + 1 = 4" in caplog.text
    too_many = dataclasses.replace(args, speculative_eagle_topk=4, speculative_num_draft_tokens=38)
    with pytest.raises(ValueError, match="exceeds the 37 tokens a draft of 3 steps with top-4"):
        resolve_speculative(too_many, target, target, 256)


def test_draft_formats_and_vocab_checks(seed_ckpt, tmp_path, caplog):
    """A draft with a shorter context loads raised to the target's, with one warning; the token
    map may be a directory; a STANDALONE draft with another tokenizer is refused naming both."""
    with caplog.at_level(logging.WARNING, logger="spec_engine.args.resolve"):
        with Engine(
            model_path=seed_ckpt["Llama-2-7b-chat-hf"],
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=seed_ckpt["sglang-EAGLE-llama2-chat-7B"],
            speculative_num_steps=2,
            speculative_eagle_topk=1,
            speculative_token_map=seed_ckpt["LLaMA3-Instruct-8B-FR-Spec"],
            skip_server_warmup=True,
        ) as engine:
            assert engine.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0})["output_ids"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "max_position_embeddings (256) is below the target's context length 512" in line
    other = tmp_path / "other-tokenizer"
    from tiny.checkpoints import build_tiny_model

    build_tiny_model(str(other), "qwen2", vocab_size=448)
    with pytest.raises(ValueError, match="their tokenizers differ") as err:
        Engine(
            model_path=seed_ckpt["Qwen2.5-7B-Instruct"],
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(other),
            speculative_num_steps=2,
            speculative_eagle_topk=1,
        )
    assert "vocab_size is 448" in str(err.value) and "the target's 576" in str(err.value)


def test_pytorch_bin_and_safetensors_load_the_same(seed_ckpt, tmp_path):
    """A draft saved as pytorch_model.bin holds the tensors a safetensors copy holds."""
    from safetensors.torch import save_file

    from spec_engine.weights.loader import iterate_checkpoint

    bin_dir = seed_ckpt["sglang-EAGLE-llama2-chat-7B"]
    from_bin = dict(iterate_checkpoint(bin_dir))
    save_file({k: v.contiguous() for k, v in from_bin.items()}, str(tmp_path / "model.safetensors"))
    from_st = dict(iterate_checkpoint(str(tmp_path)))
    assert from_bin.keys() == from_st.keys()
    assert all(torch.equal(from_bin[k], from_st[k]) for k in from_bin)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="could not read the weights file .*pytorch_model.bin"):
        list(iterate_checkpoint(str(tmp_path)))


def test_slime_sglang_lines_pass_train_dry_run(seed_ckpt, tmp_path):
    """slime's page: its SGLANG_ARGS and known-issue workarounds, given to scripts/train.py."""
    from tests.support.forkserver import run_main

    script = (
        f"CKPT={shlex.quote(seed_ckpt['dir'])}; source examples/sglang_seeds/commands.sh; "
        'printf "%s\\n" "${SLIME_SGLANG_ARGS[@]}"'
    )
    flags = subprocess.run(
        ["bash", "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "--sglang-attention-backend" in flags and "160" in flags
    # scripts.train's main in a process forked from tests/support/forkserver.py's server
    proc = run_main(
        "scripts.train",
        [
            "--hf-checkpoint",
            seed_ckpt["MiMo-7B-RL"],
            "--prompt-data",
            seed_ckpt["task.jsonl"],
            "--input-key",
            "input",
            "--label-key",
            "label",
            "--rm-type",
            "tiny",
            "--rollout-batch-size",
            "2",
            "--num-rollout",
            "1",
            "--output-dir",
            str(tmp_path),
            *flags,
            "--dry-run",
        ],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "speculative EAGLE: draft MTP" in proc.stdout
    assert "steps 3, topk 1, 4 draft tokens" in proc.stdout
