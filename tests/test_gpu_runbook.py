"""The GPU runbook's pieces run here too: the pinned package list agrees with the [gpu] extra,
the environment step runs without a GPU, and the summary reads the benchmarks' own JSON."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib


def test_pack_list_pins_the_gpu_extra():
    out = subprocess.run(
        ["bash", "scripts/gpu/pack.sh", "--list"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    with open("pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["gpu"]
    assert extra == ["flashinfer-python==0.6.18"]
    engine, trainer = out.stdout.splitlines()
    assert extra[0] in engine.split()
    assert {"megatron-core==0.16.1", "ray==2.60.0"} <= set(trainer.split())
    pinned = engine.split()[1:] + trainer.split()[1:]
    assert all(re.fullmatch(r"[\w.-]+==[\w.]+", p) for p in pinned), pinned


def test_env_step_runs_without_a_gpu(tmp_path):
    out = subprocess.run(
        ["bash", "scripts/gpu/runbook.sh", "env"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OUT": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    env = (tmp_path / "env.txt").read_text()
    assert "available False" in env and "transformers present" in env


def test_summary_reads_the_benchmarks_json(tmp_path):
    """A tiny forced-acceptance run stands in for the GPU steps' JSON."""
    bench = tmp_path / "eagle3.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.bench_rollout",
            "--hidden-size",
            "64",
            "--num-layers",
            "2",
            "--vocab-size",
            "512",
            "--batch-sizes",
            "1",
            "--input-len",
            "8",
            "--output-len",
            "9",
            "--repeats",
            "1",
            "--steps",
            "2",
            "--topk",
            "1",
            "--algorithms",
            "baseline",
            "eagle3",
            "--forced-acceptance",
            "--json",
            str(bench),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (tmp_path / "decode.json").write_text(bench.read_text())
    (tmp_path / "env.txt").write_text("device NVIDIA H100 80GB HBM3 85000000000\n")
    summary = subprocess.run(
        [sys.executable, "-m", "scripts.gpu.summarize", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "Device: NVIDIA H100 80GB HBM3" in summary
    eagle = [r for r in json.loads(bench.read_text())["results"] if r["algorithm"] == "eagle3"]
    assert "| 1 | " in summary and f"| {eagle[0]['accept_length']} |" in summary
    assert "## Weight updates (8B, bf16)\n\nnot run" in summary
