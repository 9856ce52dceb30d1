"""The GPU runbook's pieces run here too: the pinned package list agrees with the [gpu] extra,
the environment step runs without a GPU, and the summary reads the benchmarks' own JSON."""

from __future__ import annotations

import json
import os
import re
import shutil
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
    """The H200's own decode and EAGLE-3 JSON (docs/benchmarks/gpu_NVIDIA_H200) summarized anew."""
    gpu = os.path.join("docs", "benchmarks", "gpu_NVIDIA_H200")
    for name in ("decode.json", "eagle3.json"):
        shutil.copy(os.path.join(gpu, name), tmp_path / name)
    bench = tmp_path / "eagle3.json"
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
