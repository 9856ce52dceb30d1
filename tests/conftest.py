"""Shared fixtures: tiny random checkpoints (saved by transformers) with a locally trained
tokenizer,
and a transformers reference to compare against."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tiny.checkpoints import build_checkpoint, build_tokenizer

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Feature coverage per family: llama has llama3 rope scaling, GQA and an untied head; qwen2 has
# q/k/v biases and tied embeddings; qwen3 has q/k norms and head_dim != hidden / heads; the GLM
# ones have MoE MLPs.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(
        arch="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", head_dim=32),
    # GLM-4.5 MoE (tiny.checkpoints.GLM4_MOE_TINY): q/k/v biases, partial rotary, grouped
    # sigmoid routing with a correction bias, shared expert, a dense first layer; one variant with
    # q/k norms and an MTP layer in the checkpoint, one without q/k norms or top-k renormalising.
    "glm4_moe": dict(
        arch="glm4_moe", num_layers=3, head_dim=32, extra_config={"num_nextn_predict_layers": 1}
    ),
    "glm4_moe_no_qk_norm": dict(
        arch="glm4_moe",
        extra_config={"use_qk_norm": False, "norm_topk_prob": False, "num_nextn_predict_layers": 0},
    ),
}
# GLM-4.5-Air as its config.json differs from GLM-4.5's: no q/k norms, one expert group; with
# its next-n layer (the release-layout tests).
GLM45_AIR: dict[str, Any] = dict(
    arch="glm4_moe",
    num_layers=3,
    extra_config={
        "use_qk_norm": False,
        "n_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 1,
    },
)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tokenizer"))
    build_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def make_model(tmp_path_factory, tokenizer_dir):
    """make_model(arch=..., **checkpoint kwargs) -> path of a cached tiny checkpoint."""
    cache: dict[str, str] = {}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    bos, eos = tok.convert_tokens_to_ids(["<s>", "</s>"])

    def make(arch: str = "llama", **kwargs: Any) -> str:
        key = json.dumps({"arch": arch, **kwargs}, sort_keys=True)
        if key not in cache:
            d = str(tmp_path_factory.mktemp(arch))
            for name in os.listdir(tokenizer_dir):
                shutil.copy(os.path.join(tokenizer_dir, name), d)
            build_checkpoint(d, arch=arch, bos_token_id=bos, eos_token_id=eos, **kwargs)
            cache[key] = d
        return cache[key]

    return make


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family_path(request, make_model) -> str:
    return make_model(**FAMILIES[request.param])


@pytest.fixture(scope="session")
def llama_path(make_model) -> str:
    return make_model(**FAMILIES["llama"])


class HFReference:
    """Greedy generation and log-probs from transformers, the oracle for the engine."""

    def __init__(self) -> None:
        self._models: dict[str, Any] = {}

    def model(self, path: str):
        from transformers import AutoModelForCausalLM

        if path not in self._models:
            self._models[path] = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32
            ).eval()
        return self._models[path]

    @torch.no_grad()
    def greedy(
        self, path: str, prompt: list[int], max_new_tokens: int
    ) -> tuple[list[int], list[float]]:
        """Tokens of generate(do_sample=False) and the log-softmax of each chosen token."""
        out = self.model(path).generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [
            torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)
        ]
        return tokens, logprobs

    @torch.no_grad()
    def next_token_logits(self, path: str, prompt: list[int]) -> torch.Tensor:
        return self.model(path)(torch.tensor([prompt])).logits[0, -1].float()


@pytest.fixture(scope="session")
def rl_task(make_model, tmp_path_factory) -> tuple[str, str]:
    """(a tiny MiMo model with one MTP layer, the tiny task's prompts): what the RL-loop tests
    run on."""
    from transformers import AutoTokenizer

    from rollout.tiny_task import write_tiny_task
    from tiny.checkpoints import add_mimo_mtp

    model = add_mimo_mtp(make_model("qwen2", num_layers=2, seed=41), seed=42)
    data = str(tmp_path_factory.mktemp("task") / "task.jsonl")
    write_tiny_task(data, AutoTokenizer.from_pretrained(model), n=32)
    return model, data


def train_env() -> dict[str, str]:
    """The environment of a scripts/train.py subprocess: this checkout importable, and no
    torch.distributed variables a parent launcher may have set (the run starts its own)."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("MASTER_")},
        "PYTHONPATH": os.getcwd(),
    }


class LoopRun:
    """scripts/train.py with `argv` (forked from tests/support/forkserver.py's server), started
    at once and left running meanwhile (a test can do other work, e.g. start other runs, before
    it waits with finished()); its stdout and stderr in `root`, its --output-dir `out`. Runs in a
    session of its own: stop() ends what it started."""

    def __init__(self, argv: list[str], root: str, out: str) -> None:
        from tests.support.forkserver import Session

        self.out = out
        self._logs = [os.path.join(root, name) for name in ("stdout.log", "stderr.log")]
        for path in self._logs:
            open(path, "w").close()
        self.proc = Session("scripts.train", argv, *self._logs)
        self._result: subprocess.CompletedProcess | None = None

    def ray_started(self, timeout: float = 240) -> None:
        """Waits until the run's Ray is up (or the run has ended): another run starting its own
        Ray only then keeps two Ray startups from competing (a node that starts too slowly
        times out)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            with open(self._logs[0]) as f:
                if " engine(s) and " in f.read():
                    return
            time.sleep(0.2)

    def finished(self, timeout: float = 400) -> subprocess.CompletedProcess:
        """Waits for the run; its stdout and stderr, once it has exited 0."""
        if self._result is None:
            try:
                code = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                raise
            stdout, stderr = (open(path).read() for path in self._logs)
            self._result = subprocess.CompletedProcess(self.proc.args, code, stdout, stderr)
        assert self._result.returncode == 0, self._result.stderr[-3000:]
        return self._result

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class RLLoopRun(LoopRun):
    """scripts/train.py with test_train_loop.py's loop_args, started when the first test asks for
    it (LoopRun)."""

    def __init__(self, model: str, data: str, root: str) -> None:
        from tests.e2e.test_train_loop import loop_args

        self.out = os.path.join(root, "run")
        self.saved_rollouts = os.path.join(root, "rollouts", "r{rollout_id}.pt")
        argv = loop_args(model, data, self.out)
        argv += ["--save-debug-rollout-data", self.saved_rollouts]
        super().__init__(argv, root, self.out)


@pytest.fixture(scope="session")
def rl_loop_run(rl_task, tmp_path_factory) -> Iterator[RLLoopRun]:
    """One RL loop on the RL task, shared (each such run costs a Ray, an engine and two trainer
    ranks starting): tests/e2e/test_train_loop.py checks the loop and replays its saved rollouts;
    tests/e2e/test_checkpoint.py compares a killed and resumed run with it, bit for bit, and runs
    the killed one while this one runs."""
    run = RLLoopRun(*rl_task, str(tmp_path_factory.mktemp("rl_loop")))
    yield run
    run.stop()


@pytest.fixture(scope="session")
def partial_rollout_run(rl_task, make_model, tmp_path_factory) -> tuple[str, str]:
    """(the output directory, the --save-debug-rollout-data path) of one scripts/train.py run on
    the RL task, shared (each such run costs a Ray, an engine and a trainer rank starting):
    --partial-rollout (tests/e2e/test_partial_rollout_loop.py's partial_args, which checks it),
    starting from another checkpoint of the model with --ref-load, a KL loss to it
    (tests/e2e/test_train_loop.py's ref_load_args, which checks that start)."""
    from tests.e2e.test_partial_rollout_loop import partial_args
    from tests.e2e.test_train_loop import ref_load_args, run
    from tiny.checkpoints import add_mimo_mtp

    model, data = rl_task
    other = add_mimo_mtp(make_model("qwen2", num_layers=2, seed=43), seed=44)
    root = tmp_path_factory.mktemp("partial_rollout")
    out, saved = str(root / "out"), str(root / "rollouts" / "r{rollout_id}.pt")
    run(partial_args(model, data, out, saved) + ref_load_args(other))
    return out, saved


# What the shared --debug-rollout-only run executes: the loop's main (specrl.loop) with closing the
# metrics log failing, then a check that megatron was never imported.
ROLLOUT_ONLY_MAIN = """
import ray
import rollout.metrics
def broken_close(self):
    raise RuntimeError("disk gone")
rollout.metrics.MetricsLogger.close = broken_close
from specrl.loop import main
try:
    main(sys.argv[1:])
except RuntimeError as e:
    assert "disk gone" in str(e), e
    assert not ray.is_initialized(), "a failed shutdown step left Ray running"
    print("shut down")
else:
    raise SystemExit("the failing close was not reported")
assert not [m for m in sys.modules if m.startswith("megatron")], "megatron was imported"
"""


@pytest.fixture(scope="session")
def rollout_only_run(rl_task, tmp_path_factory) -> tuple[subprocess.CompletedProcess, str]:
    """(the finished process, its output directory) of one scripts/train.py
    --debug-rollout-only run on the RL task, shared by the tests that read it (each such run
    costs a Ray and an engine start): three rollouts with --use-fault-tolerance and health
    checks, the engine killed mid-request in rollout 0 and stopped (hung) in rollout 1
    (tests/support/engine_killer.py), and closing the metrics log failing at the end
    (ROLLOUT_ONLY_MAIN). tests/e2e/test_fault_tolerance.py checks the restarts,
    tests/e2e/test_train_loop.py the shutdown and that megatron is never imported,
    tests/e2e/test_engine_tp_loop.py its rollout 0 (saved under out/rollouts/)."""
    from tests.e2e.test_train_loop import base_args

    model, data = rl_task
    out = str(tmp_path_factory.mktemp("rollout_only") / "run")
    argv = base_args(model, data, out)
    argv[argv.index("--num-rollout") + 1] = "3"
    argv += ["--debug-rollout-only", "--use-fault-tolerance"]
    # tests/e2e/test_engine_tp_loop.py compares rollout 0 with a tp-2 engine's
    argv += ["--save-debug-rollout-data", os.path.join(out, "rollouts", "{rollout_id}.pt")]
    argv += ["--rollout-health-check-interval", "0.5", "--rollout-health-check-timeout", "2"]
    argv += ["--rollout-health-check-first-wait", "0"]
    argv += [
        "--custom-generate-function-path",
        "tests.support.engine_killer.generate_then_kill_then_hang_engine",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; " + ROLLOUT_ONLY_MAIN, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=train_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, out


@pytest.fixture(scope="session")
def hf() -> HFReference:
    return HFReference()


def random_prompts(
    count: int, min_len: int, max_len: int, vocab: int = 512, seed: int = 0
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=g).tolist()
    # Ids from 5 up: 0-4 are the special tokens (pad, bos, eos, chat markers).
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
