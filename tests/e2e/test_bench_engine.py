"""The benchmark script runs end to end (tiny sizes) and reports both engines."""

from __future__ import annotations

import json
import re
import sys

import pytest

# Batch 2, 16 prompt and 8 new tokens, two rounds: what the paired-round tests run.
TWO_ROUNDS = ("--batch-sizes", "2", "--input-len", "16", "--output-len", "8", "--repeats", "2")


def run_bench_rollout(capsys, *flags: str) -> str:
    """What `python -m scripts.bench_rollout` runs (its main()), on a tiny random Llama (and its
    drafts) with `flags`, in this process: a second interpreter would import torch and the engine
    again. Its stdout."""
    from bench import rollout

    capsys.readouterr()
    rollout.main(["--hidden-size", "64", "--num-layers", "2", "--vocab-size", "512", *flags])
    return capsys.readouterr().out


def test_bench_engine_script_runs(tmp_path, capsys):
    """Its main() in this process (what `python -m scripts.bench_engine` runs)."""
    from bench import engine

    out_json = tmp_path / "bench.json"
    engine.main(
        ["--hidden-size", "64", "--num-layers", "2", "--vocab-size", "512"]
        + ["--batch-sizes", "1", "3", "--input-len", "8", "--output-len", "5", "--repeats", "1"]
        + ["--json", str(out_json)]
    )
    assert "| 3 |" in capsys.readouterr().out
    results = json.loads(out_json.read_text())["results"]
    assert [r["batch"] for r in results] == [1, 3]
    assert all(r["spec_engine_tok_s"] > 0 and r["transformers_tok_s"] > 0 for r in results)


def test_bench_rollout_script_runs(tmp_path, capsys):
    out_json = tmp_path / "rollout.json"
    stdout = run_bench_rollout(
        capsys,
        *TWO_ROUNDS,
        "--interleave",  # every engine open at once, rounds round-robin
        "--json",
        str(out_json),
        "--plot",
        str(tmp_path / "speedup.svg"),
    )
    results = json.loads(out_json.read_text())["results"]
    plot = (tmp_path / "speedup.svg").read_text()
    # The axes, then one line per configuration, baseline's at exactly 1x.
    assert plot.count("<polyline") == 1 + len(results)
    assert all(f">{r['algorithm']}</text>" in plot for r in results)
    assert {r["algorithm"] for r in results} == {
        "baseline",
        "eagle",
        "eagle3",
        "mtp",
        "mtp-plain",
        "standalone-self",
        "ngram",
        "ngram-adaptive",
        "eagle3-adaptive",
        "mtp-adaptive",
    }
    # Each adaptive configuration against the better of its fixed speculation and plain decoding
    # of its own target (MTP's: MiMo without speculation).
    ratios = json.loads(out_json.read_text())["adaptive_vs_best"]
    assert {(e["algorithm"], e["plain"], e["fixed"]) for e in ratios} == {
        ("ngram-adaptive", "baseline", "ngram"),
        ("eagle3-adaptive", "baseline", "eagle3"),
        ("mtp-adaptive", "mtp-plain", "mtp"),
    }
    rate = {(r["algorithm"], r["batch"]): r["tokens_per_s"] for r in results}
    mtp = next(e for e in ratios if e["algorithm"] == "mtp-adaptive")
    assert mtp["tokens_per_s"] == pytest.approx(
        rate[("mtp-adaptive", 2)] / max(rate[("mtp-plain", 2)], rate[("mtp", 2)]), abs=1e-3
    )
    # Round by round: the median of each round's ratio (the rounds ran side by side).
    rounds = {(r["algorithm"], r["batch"]): r["round_tokens_per_s"] for r in results}
    paired = sorted(
        a / max(p, s)
        for a, p, s in zip(
            rounds[("mtp-adaptive", 2)], rounds[("mtp-plain", 2)], rounds[("mtp", 2)]
        )
    )
    assert len(paired) == 2 and mtp["paired_median"] == pytest.approx(sum(paired) / 2, abs=1e-3)
    assert "adaptive / max(plain, fixed)" in stdout
    assert all(r["decode_tokens_per_s"] > 0 for r in results)
    for adaptive in (r for r in results if r["algorithm"].endswith("-adaptive")):
        assert 0.0 <= adaptive["speculative_step_share"] <= 1.0
        # why it chose: this batch's fitted costs, and the warm-up's and the round's steps
        model = adaptive["cost_model"]
        assert model["bucket"]["plain_s_per_req"] > 0
        steps = model["latest_steps"]
        assert all(b == adaptive["batch"] and ms > 0 for _, b, ms in steps)
        # the round's steps are the last ones listed, in the modes it counted
        counted = {int(m): n for m, n in adaptive["steps_by_depth"].items()}
        last = [m for m, _, _ in steps[-sum(counted.values()) :]]
        assert {m: last.count(m) for m in counted} == counted
    assert all(r["cost_model"] is None for r in results if r["algorithm"] == "baseline")
    self_draft = next(r for r in results if r["algorithm"] == "standalone-self")
    assert self_draft["accept_length"] > 3.0 and set(self_draft["ms_per_step"]) == {
        "draft",
        "verify",
        "bookkeeping",
    }


def test_bench_weight_sync_script_runs(tmp_path, monkeypatch):
    """Its main() in this process (what `python -m scripts.bench_weight_sync` runs, without a
    second interpreter importing torch and the engine again); its engine processes are
    spawned as from the command line."""
    from bench import weight_sync

    out_json = tmp_path / "ws.json"
    argv = ["--hidden-size", "64", "--num-layers", "2", "--vocab-size", "512", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", ["bench_weight_sync", *argv, "--json", str(out_json)])
    weight_sync.main()
    paths = {r["path"] for r in json.loads(out_json.read_text())["results"]}
    assert paths == {
        "memcpy",
        "tensor",
        "flattened_bucket",
        "ipc_handles",
        "distributed_gloo",
        "disk",
        "cpu_repack_only",
        "colocated_process",
    }


def test_bench_step_split_times_each_engines_steps_and_calls():
    """scripts/bench_step_split: per engine, its scheduler steps and the worker calls inside
    them (a plain engine's decodes, an adaptive one's plain decodes and tries) each timed. In a
    process of its own (it patches Scheduler.step), from tests/support/forkserver.py's server."""
    from tests.support.forkserver import run_main

    proc = run_main(
        "scripts.bench_step_split",
        ["--hidden-size", "64", "--num-layers", "2", "--vocab-size", "512", *TWO_ROUNDS]
        + ["--algorithms", "baseline", "eagle3-adaptive"],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = proc.stdout.split("all rounds and the warm-up\n")[1].splitlines()
    calls = {
        engine: {name: int(n) for name, n in re.findall(r"(\w+) [0-9.]+ \[(\d+)\]", row)}
        for row in rows
        for engine in ("ModelWorker", "EagleWorker+adaptive")
        if row.startswith(engine + " #")
    }
    plain, adaptive = calls["ModelWorker"], calls["EagleWorker+adaptive"]
    # the warm-up's and two rounds' generations of 8 tokens: 7 decode steps each, and 5 prefills
    # (those three and two prefill-only runs): 26 scheduler steps. The plain engine overlaps
    # (core/overlap.py): it launches one more step each, which the requests finish during; that
    # step is read by the next call or, when the engine's loop gets there first, a step of its
    # own (timing decides which).
    assert plain["decode"] == plain["decode_read"] == 24 and "decode_plain" not in plain
    assert adaptive["decode"] + adaptive["decode_plain"] == 21 and "decode_read" not in adaptive
    assert adaptive["step"] == 26 and plain["step"] >= 26 and plain["prefill"] == 5


def test_bench_rollout_forced_acceptance_accepts_every_draft(tmp_path, capsys):
    """--forced-acceptance (the speed a perfect draft would give): a random EAGLE-3 draft's
    tokens are all accepted, so a verify emits a full path."""
    out_json = tmp_path / "forced.json"
    stdout = run_bench_rollout(
        capsys,
        "--batch-sizes",
        "1",
        "--input-len",
        "16",
        "--output-len",
        "17",
        "--repeats",
        "1",
        "--steps",
        "3",
        "--topk",
        "1",
        "--algorithms",
        "baseline",
        "eagle3",
        "--forced-acceptance",
        "--json",
        str(out_json),
    )
    results = {r["algorithm"]: r for r in json.loads(out_json.read_text())["results"]}
    assert results["eagle3"]["accept_length"] == 4.0  # 16 decode tokens in 4 verifies of 3 + 1
    assert "forced acceptance" in stdout


@pytest.fixture
def forked_engines(monkeypatch) -> None:
    """bench.isolate's engine processes forked from tests/support/forkserver.py's server (torch
    and the engine imported) instead of spawned: each still a process of its own, opened afresh
    and closed, but without seconds of imports each."""
    from types import SimpleNamespace

    from bench import isolate
    from tests.support import forkserver

    ctx = forkserver.context()
    monkeypatch.setattr(isolate, "multiprocessing", SimpleNamespace(get_context=lambda _: ctx))


@pytest.mark.parametrize("mode", ["--isolate", "--lockstep", "--lockstep --in-process"])
def test_bench_rollout_isolate_opens_a_fresh_engine_process_every_round(
    tmp_path, mode, capsys, forked_engines
):
    """--isolate: each configuration's engine in a process of its own, every round; the rounds
    still pair up for the adaptive rows' paired median, and baseline-twin's (a second plain
    engine) with baseline's for the noise floor. --lockstep: the same processes, measured at
    once through their step gates (--in-process: threads of this process, and each step also by
    its thread's CPU clock)."""
    out_json = tmp_path / "isolated.json"
    stdout = run_bench_rollout(
        capsys,
        *TWO_ROUNDS,
        "--algorithms",
        "baseline",
        "baseline-twin",
        "ngram-adaptive",
        *mode.split(),
        "--json",
        str(out_json),
    )
    report = json.loads(out_json.read_text())
    assert report["args"]["lockstep"] is mode.startswith("--lockstep")
    cpu_rounds = [r.get("round_tokens_per_cpu_s") for r in report["results"]]
    if mode.startswith("--lockstep"):  # by the CPU clock too: at least as fast as by the wall's
        for r, cpu in zip(report["results"], cpu_rounds):
            assert len(cpu) == 2 and all(
                c >= 0.99 * w for c, w in zip(cpu, r["round_tokens_per_s"])
            )
    else:
        assert cpu_rounds == [None] * 3
    rounds = {r["algorithm"]: r["round_tokens_per_s"] for r in report["results"]}
    assert set(rounds) == {"baseline", "baseline-twin", "ngram-adaptive"}
    assert all(len(v) == 2 and min(v) > 0 for v in rounds.values())
    assert all(r["weight_bytes"] > 0 for r in report["results"])
    (ratio,) = report["adaptive_vs_best"]  # no fixed ngram row: against plain decoding alone
    assert (ratio["plain"], ratio["fixed"]) == ("baseline", None)
    paired = sorted(a / p for a, p in zip(rounds["ngram-adaptive"], rounds["baseline"]))
    assert ratio["paired_median"] == pytest.approx(sum(paired) / 2, abs=1e-3)
    (noise,) = report["noise"]
    twins = sorted(a / p for a, p in zip(rounds["baseline-twin"], rounds["baseline"]))
    assert noise["paired_median"] == pytest.approx(sum(twins) / 2, abs=1e-3)
    assert (noise["paired_min"], noise["paired_max"]) == pytest.approx(twins, abs=1e-3)
    assert "baseline-twin / baseline (identical engines)" in stdout


class _GatedThread:
    """drive's view of a gated engine process, with a thread in place of the process: a
    scheduler whose step logs its name and sleeps, run `steps` times under a StepGate."""

    def __init__(self, name: str, steps: int, seconds: float, log: list[str]) -> None:
        import multiprocessing
        import threading
        import time
        from types import SimpleNamespace

        from bench.isolate import StepGate

        self.gate, child_gate = multiprocessing.Pipe()
        self._answers, child_answers = multiprocessing.Pipe()
        step = lambda: (log.append(name), time.sleep(seconds))  # noqa: E731
        engine = SimpleNamespace(scheduler=SimpleNamespace(step=step), get_server_info=dict)
        gate = StepGate(child_gate)
        gate.install(engine)

        def child() -> None:
            gate.on = True
            start, wall = gate.clock(engine), time.perf_counter()
            for _ in range(steps):
                engine.scheduler.step()
            child_answers.send(("ok", (gate.clock(engine) - start, time.perf_counter() - wall)))

        threading.Thread(target=child, daemon=True).start()

    @property
    def readers(self) -> list:
        return [self.gate, self._answers]

    def answered(self) -> bool:
        return self._answers.poll()

    def answer(self) -> tuple[float, float]:
        return self._answers.recv()[1]


def test_drive_gives_gated_engines_one_step_each_in_turn_and_each_times_its_own_steps():
    from bench.isolate import drive

    log: list[str] = []
    engines = {
        "slow": _GatedThread("slow", 3, 0.05, log),
        "fast": _GatedThread("fast", 5, 0.0, log),
    }
    answers = drive(engines)
    assert log == ["slow", "fast"] * 3 + ["fast"] * 2
    (slow_busy, _), (fast_busy, fast_wall) = answers["slow"], answers["fast"]
    assert 0.15 <= slow_busy < 0.3
    # The fast engine waited out the slow one's steps, but its clock counts its own alone.
    assert fast_wall >= 0.1 and fast_busy < 0.02


def test_engine_process_runs_calls_in_its_own_process_and_reports_failures(
    llama_path, forked_engines
):
    import argparse
    import os

    from bench.isolate import EngineProcess

    with open(os.path.join(llama_path, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]

    args = argparse.Namespace(
        device="cpu",
        dtype="float32",
        disable_cuda_graph=True,
        enable_deterministic_inference=False,
        attention_backend=None,
        context_length=64,
        forced_acceptance=False,
        input_len=8,
        output_len=4,
        vocab_size=vocab_size,
    )
    with EngineProcess(llama_path, {}, 2, args) as engine:
        assert engine.pid != os.getpid()
        result = engine.call("measure", False, 0)
        assert result["tokens"] == 2 * 4 and result["elapsed"] > 0
        with pytest.raises(ValueError, match="no benchmark call 'generate'"):
            engine.call("generate")
        # An exception in the child comes back with its traceback; the engine serves on.
        with pytest.raises(RuntimeError, match="in the benchmark engine process"):
            engine.call("measure", False)
        assert engine.call("measure", False, 1)["tokens"] == 8
    with pytest.raises(RuntimeError, match="does-not-exist"):
        EngineProcess(str(llama_path) + "-does-not-exist", {}, 2, args)
