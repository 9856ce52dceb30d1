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
    """The H200's own decode and EAGLE-3 JSON (docs/benchmarks/data/gpu_NVIDIA_H200), summarized
    anew."""
    gpu = os.path.join("docs", "benchmarks", "data", "gpu_NVIDIA_H200")
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


def test_adaptive_probe_runs_on_the_cpu(tmp_path):
    """scripts.gpu.probe_adaptive (the runbook's `probe` step) on tiny checkpoints built by
    bench_rollout: per-step times per case, the forced case alternating plain and deepest steps,
    a host profile of the timed generation, and the cases alternating over rounds."""
    tiny = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2"]
    tiny += ["--vocab-size", "512", "--context-length", "128"]
    subprocess.run(
        [sys.executable, "-m", "scripts.bench_rollout", *tiny, "--algorithms", "eagle3"]
        + ["--batch-sizes", "1", "--input-len", "8", "--output-len", "2", "--repeats", "1"]
        + ["--work-dir", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    out = tmp_path / "probe.json"
    probe = subprocess.run(
        [sys.executable, "-m", "scripts.gpu.probe_adaptive", "--work-dir", str(tmp_path)]
        + ["--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native"]
        + ["--context-length", "128", "--input-len", "8", "--output-len", "12", "--vocab", "500"]
        + ["--batch", "2", "--profile", "python", "--profile-steps", "2", "--json", str(out)]
        + ["--cases", "fixed", "adaptive_forced_plain_then_deepest", "--rounds", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) == {
        "batch",
        "device",
        "fixed",
        "adaptive_forced_plain_then_deepest",
        "rounds",
    }
    assert {len(v) for v in result["rounds"].values()} == {2} and len(result["rounds"]) == 2
    forced = result["adaptive_forced_plain_then_deepest"]
    modes = [kind for kind, _, _ in forced["steps"] if kind != "catch_up"]
    assert set(modes) == {"plain", "spec"} and all(a != b for a, b in zip(modes, modes[1:]))
    assert forced["summary"]["spec_after"].keys() == {"plain"}
    assert "ncalls" in result["fixed"]["profile"] and result["fixed"]["tokens_per_s"] > 0
