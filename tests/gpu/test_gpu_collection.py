"""`pytest -m gpu` on a GPU machine with the runtime only: collection must not need the dev
extra's clients (openai, httpx), uvicorn or flashinfer; the tests that need one skip."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import FAMILIES


def test_gpu_tests_collect_without_optional_packages(tmp_path):
    # A directory first on the path whose packages refuse to import: as if not installed.
    for name in ("openai", "httpx", "uvicorn", "flashinfer"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError('No module named {name}')\n"
        )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()]))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            # what the runbook runs (collecting the whole suite takes 20 s)
            "tests/gpu/test_gpu.py",
            "tests/gpu/test_gpu_moe.py",
            "tests/gpu/test_gpu_adaptive.py",
            "tests/gpu/test_gpu_scale.py",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    collected = [line for line in lines if "tests/gpu/test_gpu.py::" in line]
    # One float32 greedy test per model family, and eleven others.
    assert len(collected) == len(FAMILIES) + 11, out.stdout[-3000:]
    assert sum("tests/gpu/test_gpu_moe.py::" in line for line in lines) == 5, out.stdout[-3000:]
    assert sum("tests/gpu/test_gpu_adaptive.py::" in line for line in lines) == 4, out.stdout[
        -3000:
    ]
    assert sum("tests/gpu/test_gpu_scale.py::" in line for line in lines) == 5, out.stdout[-3000:]
