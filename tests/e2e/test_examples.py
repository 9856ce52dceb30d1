"""Every example in examples/ runs as a user would run it (a process of its own from the repo root:
the shell scripts as subprocesses, the Python scripts as __main__ in a process forked from
tests/support/forkserver.py's server, torch and the engine already imported) and does what it
says: real outputs are checked, not just the exit status."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Example:
    """An example running as a subprocess from the repo root, in a process group of its own so
    that stop() reaches everything it started (a server, train.py and its Ray)."""

    def __init__(self, cmd: list[str], log_dir: Path, timeout: float, **env: str) -> None:
        self.cmd, self.log_dir, self.timeout = cmd, log_dir, timeout
        log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout, self.stderr = log_dir / "stdout.log", log_dir / "stderr.log"
        # Drop torch.distributed variables a parent launcher may have set: examples start their own.
        base = {k: v for k, v in os.environ.items() if not k.startswith("MASTER_")}
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                stdout=out,
                stderr=err,
                env={**base, "PYTHONPATH": str(REPO), **env},
                start_new_session=True,
            )

    def wait(self) -> str:
        """Wait for a successful exit; returns the example's stdout."""
        try:
            code = self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"{self.cmd} ran over {self.timeout}s:\n{self.output()}")
        assert code == 0, f"{self.cmd} failed:\n{self.output()}"
        return self.stdout.read_text()

    def output(self) -> str:
        return f"{self.stdout.read_text()[-2000:]}\n{self.stderr.read_text()[-3000:]}"

    def stop(self) -> None:
        """Interrupt a run still going (train.py then shuts Ray down), killing it if it hangs."""
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run(cmd: list[str], log_dir: Path, timeout: float, **env: str) -> str:
    """Run an example to completion; returns its stdout."""
    return Example(cmd, log_dir, timeout, **env).wait()


def run_script(script: str, argv: list[str], timeout: float) -> str:
    """`python examples/<script> *argv` from the repo root, forked from the server; its stdout."""
    from tests.support.forkserver import python_c

    code = f"import runpy; runpy.run_path({str(EXAMPLES / script)!r}, run_name='__main__')"
    proc = python_c(code, argv, timeout, cwd=str(REPO))
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def metrics(out_dir: Path) -> list[dict]:
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def saved_samples(path: Path) -> list[dict]:
    """Samples written by --save-debug-rollout-data (plain dicts)."""
    return torch.load(path, weights_only=True)["samples"]


@pytest.fixture(scope="module")
def model(make_model) -> str:
    """A tiny Llama with its tokenizer, shared by the examples (4 layers for EAGLE-3)."""
    return make_model("llama", num_layers=4)


@pytest.fixture(scope="module", autouse=True)
def ray_examples(model: str, tmp_path_factory) -> Iterator[dict[str, Example]]:
    """The two scripts/train.py examples, started before the first test of the file."""
    # They mostly wait on Ray's startup, so they overlap with the other tests instead of adding
    # to the file's time.
    root = tmp_path_factory.mktemp("ray_examples")
    runs = {
        name: Example(
            ["bash", f"examples/{name}/{script}", model],
            root / name,
            timeout=240,
            OUT=str(root / name),
        )
        for name, script in (
            ("debug_rollout", "debug_rollout_only.sh"),
            ("custom_functions", "run_custom_functions.sh"),
        )
    }
    yield runs
    for example in runs.values():
        example.stop()


def test_readme_lists_every_example():
    readme = (EXAMPLES / "README.md").read_text()
    files = [p for p in EXAMPLES.rglob("*") if p.suffix in (".py", ".sh")]
    assert files
    for path in files:
        assert f"({path.relative_to(EXAMPLES)})" in readme, path


def test_serve_and_query_with_curl_and_openai(model, tmp_path):
    port = free_port()
    out = run(
        ["bash", "examples/serve/serve_and_query.sh", model], tmp_path, timeout=120, PORT=str(port)
    )
    lines = out.splitlines()
    generated = json.loads(lines[lines.index("== POST /generate") + 1])
    assert generated["text"] and len(generated["output_ids"]) == 8
    assert generated["meta_info"]["finish_reason"]["type"] == "length"
    chat = json.loads(lines[lines.index("== POST /v1/chat/completions") + 1])
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["message"]["content"] and chat["usage"]["completion_tokens"] == 8
    client = dict(re.findall(r"^(completion|chat|stream): (.*)$", out, re.MULTILINE))
    assert set(client) == {"completion", "chat", "stream"}
    # Greedy everywhere: the openai completion is the /generate text, the stream the chat reply.
    assert client["completion"] == repr(generated["text"])
    assert client["chat"] == client["stream"] and client["chat"] != "''"
    # The trap stopped the server.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_speculative_algorithms_are_lossless_and_report_acceptance(model):
    out = run_script("speculative/speculative_engine.py", ["--model-path", model], timeout=180)
    rows = re.findall(
        r"^(\w+)\s+lossless=(\w+) accept_length=\[(.*)\] verify_ct=\[(.*)\]$", out, re.MULTILINE
    )
    assert [r[0] for r in rows] == ["EAGLE", "EAGLE3", "MTP", "STANDALONE", "NGRAM"]
    accepted = {}
    for name, lossless, accept, verify in rows:
        assert lossless == "True", name
        accepted[name] = [float(a) for a in accept.split(", ")]
        verify_ct = [int(v) for v in verify.split(", ")]
        # 16 tokens: the first from prefill, the other 15 from verify passes.
        for a, v in zip(accepted[name], verify_ct, strict=True):
            assert a == pytest.approx(15 / v, abs=0.01), name
    assert all(a >= 1.0 for values in accepted.values() for a in values)
    assert accepted["NGRAM"][-1] > 1.0  # the repetitive prompt: NGRAM drafts get accepted


def test_weight_update_from_a_training_loop():
    # No --model-path: the example builds its own tiny model.
    out = run_script("weight_update/train_and_update.py", ["--steps", "4"], timeout=180)
    assert "checksums match: True" in out
    assert "engine greedy == trained model greedy: True" in out
    before = re.search(r"^before: version=(\S+) (.*)$", out, re.MULTILINE)
    after = re.search(r"^after: version=(\S+) (.*)$", out, re.MULTILINE)
    assert before and after
    assert (before[1], after[1]) == ("default", "step-4")
    assert before[2] != after[2]
    losses = re.search(r"loss ([\d.]+) -> ([\d.]+)", out)
    assert losses and float(losses[2]) < float(losses[1])


def test_debug_rollout_only(ray_examples):
    ray_examples["debug_rollout"].wait()
    out_dir = ray_examples["debug_rollout"].log_dir  # the example's OUT
    rows = metrics(out_dir)
    assert len(rows) == 2
    for row in rows:
        assert 0.0 <= row["rollout/raw_reward"] <= 1.0
        assert row["rollout/spec_accept_length"] >= 1.0  # NGRAM via --sglang-*
        assert row["rollout/weight_version"] == 0
        assert not any(key.startswith("train/") for key in row)
    for rollout_id in (0, 1):
        samples = saved_samples(out_dir / "rollouts" / f"{rollout_id}.pt")
        assert len(samples) == 8 and all(s["response_length"] > 0 for s in samples)


def test_custom_generate_and_reward_functions(ray_examples):
    from examples.custom_functions.reward import answer_reward

    ray_examples["custom_functions"].wait()
    out_dir = ray_examples["custom_functions"].log_dir  # the example's OUT
    (row,) = metrics(out_dir)
    samples = saved_samples(out_dir / "rollouts" / "0.pt")
    assert len(samples) == 8
    for s in samples:
        # The custom generate function: its turn count, and the tool's tokens masked out.
        turns = s["metadata"]["turns"]
        assert turns in (1, 2)
        assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == s["response_length"]
        assert (0 in s["loss_mask"]) == (turns == 2)
        assert len(s["weight_versions"]) == turns
        # The custom reward: it recorded the answer it scored, and its score is in the samples.
        assert s["metadata"]["answer"] == s["response"].rsplit("Answer:", 1)[-1].strip()
        fresh = SimpleNamespace(response=s["response"], label=s["label"], metadata={})
        assert s["reward"] == answer_reward(None, fresh)
    assert row["rollout/raw_reward"] == pytest.approx(sum(s["reward"] for s in samples) / 8)


def test_sglang_seed_command_serves_and_slime_lines_dry_run(tmp_path):
    """examples/sglang_seeds/run.sh builds the stand-ins, serves the first seed command (SGLang's
    EAGLE-2 example) and queries /generate; `slime` dry-runs slime's --sglang-* lines.
    tests/server/test_cli_compat.py runs every seed command in-process."""
    ckpt = str(tmp_path / "ckpt")
    out = run(
        ["bash", "examples/sglang_seeds/run.sh", "0"],
        tmp_path / "serve",
        timeout=180,
        CKPT=ckpt,
        PORT=str(free_port()),
    )
    generated = json.loads(out.strip().splitlines()[-1])
    assert len(generated["output_ids"]) == 16 and generated["meta_info"]["spec_verify_ct"] > 0
    listed = run(["bash", "examples/sglang_seeds/run.sh", "list"], tmp_path / "list", 60, CKPT=ckpt)
    assert len(listed.splitlines()) == 12
    dry = run(["bash", "examples/sglang_seeds/run.sh", "slime"], tmp_path / "slime", 120, CKPT=ckpt)
    assert "speculative EAGLE: draft MTP" in dry
