"""The runbook's results as one Markdown page naming the device, for docs/benchmarks/.

    python -m scripts.gpu.summarize RESULTS_DIR   # scripts/gpu/runbook.sh saves it as summary

Reads what scripts/gpu/runbook.sh wrote (env.txt, pytest_gpu.txt, decode.json, eagle3.json,
weight_sync.json, loop.txt); a step that did not run is said so.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

DECODE_TARGET = 0.90  # of the HBM roofline at batch 1 (SGLang reaches about 0.75)
EAGLE3_TARGET = 2.5  # speedup at batch 1 (SGLang: 2.36x with a trained draft)
COLOCATED_TARGET_S = 1.0


def load(results: str, name: str) -> Optional[Any]:
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f) if name.endswith(".json") else f.read()


def summarize(results: str) -> str:
    lines = ["# GPU runbook results", ""]
    env = load(results, "env.txt")
    device = next((ln for ln in (env or "").splitlines() if ln.startswith("device ")), None)
    lines += [f"Device: {device[len('device ') :] if device else 'unknown (env step not run)'}", ""]
    lines += ["Commands: `bash scripts/gpu/runbook.sh <step>` (docs/gpu.md).", ""]
    tests = load(results, "pytest_gpu.txt")
    last = (tests or "").strip().splitlines()[-1:] or ["not run"]
    lines += ["## pytest -m gpu", "", f"`{last[0]}`", ""]
    lines += ["## Plain decode (8B-shaped, bf16, random weights)", ""]
    lines += _decode(load(results, "decode.json"))
    lines += ["", "## EAGLE-3 at full acceptance vs plain (same run)", ""]
    lines += _eagle3(load(results, "eagle3.json"))
    lines += ["", "## Weight updates (8B, bf16)", ""]
    lines += _weights(load(results, "weight_sync.json"))
    loop = load(results, "loop.txt")
    lines += ["", "## Tiny RL run on the GPU (--colocate)", ""]
    if loop and "run summary" in loop:
        lines += ["```", loop[loop.index("run summary") :].strip(), "```"]
    else:
        lines.append("not run" if loop is None else "did not finish (see loop.txt)")
    return "\n".join(lines) + "\n"


def _decode(decode: Optional[dict]) -> list[str]:
    if not decode:
        return ["not run"]
    lines = ["| batch | tokens/s | decode tokens/s |", "|---:|---:|---:|"]
    lines += [
        f"| {r['batch']} | {r['tokens_per_s']} | {r['decode_tokens_per_s']} |"
        for r in decode["results"]
    ]
    roof = decode.get("roofline")
    if roof:
        verdict = "meets" if roof["fraction"] >= DECODE_TARGET else "misses"
        lines += [
            "",
            f"Batch 1: {100 * roof['fraction']:.1f}% of the HBM roofline "
            f"({roof['roofline_steps_per_s']} steps/s); {verdict} the {DECODE_TARGET:.0%} "
            "target.",
        ]
    return lines


def _eagle3(eagle: Optional[dict]) -> list[str]:
    if not eagle:
        return ["not run"]
    base = {r["batch"]: r["tokens_per_s"] for r in eagle["results"] if r["algorithm"] == "baseline"}
    lines = ["| batch | speedup | accept length |", "|---:|---:|---:|"]
    for r in eagle["results"]:
        if r["algorithm"] == "eagle3" and r["batch"] in base:
            speed = r["tokens_per_s"] / base[r["batch"]]
            lines.append(f"| {r['batch']} | {speed:.2f}x | {r['accept_length']} |")
    return lines + ["", f"Target: {EAGLE3_TARGET}x at batch 1 with a trained draft."]


def _weights(weights: Optional[dict]) -> list[str]:
    if not weights:
        return ["not run"]
    lines = ["| path | seconds | GB/s |", "|---|---:|---:|"]
    lines += [f"| {r['path']} | {r['seconds']} | {r['GB_per_s']} |" for r in weights["results"]]
    colocated = next(r for r in weights["results"] if r["path"] == "colocated_process")
    verdict = "meets" if colocated["seconds"] < COLOCATED_TARGET_S else "misses"
    return lines + ["", f"Colocated push {verdict} the < {COLOCATED_TARGET_S:g} s target."]


def main(argv: Optional[list[str]] = None) -> None:
    """Print the summary of the results directory named first in `argv` (default runs/gpu)."""
    argv = sys.argv[1:] if argv is None else argv
    print(summarize(argv[0] if argv else "runs/gpu"), end="")


if __name__ == "__main__":
    main()
