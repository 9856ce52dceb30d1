"""Actor failure (--use-fault-tolerance): the router has a dead engine replaced once and redoes
only the requests it lost; the launcher restarts a killed engine actor mid-rollout and the run
completes; without fault tolerance, past --max-engine-restarts, or when a trainer rank dies, the
run exits non-zero naming the checkpoint to resume from."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import pytest

from rollout.router import EngineDied, RequestAborted, Router
from specrl.checkpoint import LATEST_FILE, iter_dir
from specrl.fault_tolerance import (
    EngineRestarter,
    EngineRestartsExhausted,
    fatal_message,
    last_checkpoint,
)
from specrl.health import EngineHung, HealthMonitor
from tests.e2e.test_train_loop import base_args

# ---------------------------------------------------------------- router (fake engines)


class DyingEngine:
    """Answers input [0] at once; every other request waits until `die()`, then is lost."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []
        self.dead = asyncio.Event()

    async def async_generate(self, **kwargs):
        self.sent.append((kwargs["rid"], kwargs))
        if kwargs["input_ids"] != [0]:
            await self.dead.wait()
        if self.dead.is_set():
            raise EngineDied(0, "killed")
        return {"engine": "dying", "rid": kwargs["rid"], "input_ids": kwargs["input_ids"]}

    async def abort_request(self, rid):
        raise EngineDied(0, "killed")


class LiveEngine:
    def __init__(self, name: str) -> None:
        self.name = name
        self.sent: list[tuple[str, dict]] = []

    async def async_generate(self, **kwargs):
        self.sent.append((kwargs["rid"], kwargs))
        await asyncio.sleep(0.001)
        return {"engine": self.name, "rid": kwargs["rid"], "input_ids": kwargs["input_ids"]}

    async def abort_request(self, rid):
        pass


async def _route(router: Router, i: int):
    with router.lease(f"r{i}") as engine:
        return await engine.async_generate(
            input_ids=[i], sampling_params={"temperature": 1.0, "sampling_seed": 100 + i}
        )


def test_router_restarts_a_dead_engine_once_and_redoes_only_its_unfinished_requests():
    dying, other, fresh = DyingEngine(), LiveEngine("other"), LiveEngine("fresh")
    router = Router([dying, other])
    restarts = []

    async def restart(index, error):
        restarts.append((index, str(error)))
        await asyncio.sleep(0.01)  # the lost requests all wait for this one restart
        return fresh

    router.restart_engine = restart

    async def run():
        # Round robin over two idle engines: r0, r2, r4 go to the dying engine.
        tasks = [asyncio.ensure_future(_route(router, i)) for i in range(6)]
        while len(dying.sent) < 3 or not tasks[0].done():
            await asyncio.sleep(0)
        dying.dead.set()  # r0 has finished; r2 and r4 are lost
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert restarts == [(0, "engine 0 died (killed)")]
    assert [rid for rid, _ in dying.sent] == ["r0", "r2", "r4"]  # r0 was not sent again
    assert results[0]["engine"] == "dying"
    assert [r["input_ids"] for r in results] == [[i] for i in range(6)]
    assert [r["rid"] for r in results] == [f"r{i}" for i in range(6)]
    redone = {rid: kw for e in (other, fresh) for rid, kw in e.sent if rid in ("r2", "r4")}
    assert sorted(redone) == ["r2", "r4"]  # each once, with its rid, prompt and seed
    for rid, kwargs in redone.items():
        i = int(rid[1:])
        assert kwargs["sampling_params"]["sampling_seed"] == 100 + i
    assert router.requests_redone == 2
    assert router.engines[0] is fresh and router.outstanding == [0, 0]


def test_router_without_restart_or_past_it_fails_the_requests():
    # No restart callback: the engine's death is the request's error.
    router = Router([DyingEngine()])
    router.engines[0].dead.set()
    with pytest.raises(EngineDied, match="engine 0 died"):
        asyncio.run(_route(router, 1))

    # A restart that gives up: every lost request gets its error, from one attempt.
    router = Router([DyingEngine()])
    calls = []

    async def give_up(index, error):
        calls.append(index)
        raise EngineRestartsExhausted(f"{error}, and no restarts are left")

    router.restart_engine = give_up

    async def run():
        tasks = [asyncio.ensure_future(_route(router, i)) for i in (1, 2, 3)]
        await asyncio.sleep(0.01)
        router.engines[0].dead.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    errors = asyncio.run(run())
    assert calls == [0]
    assert all(isinstance(e, EngineRestartsExhausted) for e in errors)


def test_a_request_aborted_while_its_engine_restarts_is_not_redone():
    dying, fresh = DyingEngine(), LiveEngine("fresh")
    router = Router([dying])

    async def restart(index, error):
        await router.abort_all()  # the rollout is full meanwhile: leftovers are aborted
        return fresh

    router.restart_engine = restart

    async def run():
        task = asyncio.ensure_future(_route(router, 1))
        await asyncio.sleep(0.01)
        dying.dead.set()
        return await asyncio.gather(task, return_exceptions=True)

    (error,) = asyncio.run(run())
    assert isinstance(error, RequestAborted) and fresh.sent == []


# ---------------------------------------------------------------- the launcher's restarter


class FakeGroup:
    def __init__(self) -> None:
        self.restarted: list[int] = []
        self.restarting: set[int] = set()

    def restart(self, index):
        self.restarted.append(index)
        return f"actor{index}"

    def handle(self, index):
        return f"handle{index}"


def test_restarter_pushes_current_weights_and_stops_at_the_limit():
    group, pushed = FakeGroup(), []
    restarter = EngineRestarter(
        group, limit=1, push_weights=lambda a: pushed.append((a, set(group.restarting)))
    )
    assert asyncio.run(restarter(1, EngineDied(1, "killed"))) == "handle1"
    # Not health-checked until its weights are pushed.
    assert group.restarted == [1] and pushed == [("actor1", {1})] and restarter.used == 1
    assert group.restarting == set()
    with pytest.raises(EngineRestartsExhausted, match=r"--max-engine-restarts 1\)"):
        asyncio.run(restarter(0, EngineDied(0, "killed")))
    assert group.restarted == [1]


def test_fatal_message_names_the_last_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    args = argparse.Namespace(save=save, load=save, use_fault_tolerance=False)
    assert "holds no checkpoint yet" in last_checkpoint(args)
    os.makedirs(iter_dir(save, 3))
    with open(os.path.join(save, LATEST_FILE), "w") as f:
        f.write("3")
    message = fatal_message(EngineDied(0, "killed"), args)
    assert message == (
        f"error: engine 0 died (killed) (add --use-fault-tolerance to restart dead engines); "
        f"the last checkpoint is {save}/iter_0000003: rerun the same command with --load {save} "
        "to resume"
    )
    unsaved = argparse.Namespace(save=None, load=None, use_fault_tolerance=True)
    assert "no checkpoint was saved (--save not set)" in fatal_message(
        EngineDied(0, "killed"), unsaved
    )


def test_max_engine_restarts_must_not_be_negative():
    from specrl.train_options import parse_args

    argv = ["--hf-checkpoint", "m", "--rollout-batch-size", "1", "--num-rollout", "1"]
    with pytest.raises(SystemExit, match="--max-engine-restarts must be >= 0, got -1"):
        parse_args([*argv, "--output-dir", "o", "--max-engine-restarts", "-1"])
    assert parse_args([*argv, "--output-dir", "o"]).max_engine_restarts == 3


# ---------------------------------------------------------------- Ray


def test_a_dead_trainer_rank_is_reported_at_once():
    ray = pytest.importorskip("ray")
    from tests.support.dying_rank import Rank
    from trainer_bridge.actor.group import TrainerDied, TrainGroup

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {"PYTHONPATH": repo}
        },  # the workers import tests.support.dying_rank
    )
    try:
        group = TrainGroup.__new__(TrainGroup)  # its ranks only: no megatron
        group.actors = [ray.remote(Rank).options(num_cpus=0).remote() for _ in range(2)]
        start = time.perf_counter()
        refs = [a.work.remote(r) for r, a in enumerate(group.actors)]
        with pytest.raises(TrainerDied, match="trainer rank 1 died"):
            group._wait(refs)
        assert time.perf_counter() - start < 30
    finally:
        ray.shutdown()


# ---------------------------------------------------------------- health checks


def _until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_health_checks_kill_a_hung_engine_only_while_a_rollout_runs():
    engines = argparse.Namespace(actors=["e0", "e1", "e2", "e3"], restarting={3})
    checked, killed = [], []

    def check(actor: str, timeout: float) -> None:
        checked.append(actor)
        if actor == "e1":
            raise EngineHung(f"no answer within {timeout} s")
        if actor == "e2":
            raise RuntimeError("a check that fails otherwise is logged, and checks go on")

    monitor = HealthMonitor(engines, 0.01, 2.0, 0.0, check=check, kill=killed.append)
    time.sleep(0.1)
    assert checked == []  # no rollout running: engines may be busy with a push on purpose
    with monitor.active():
        _until(lambda: len(killed) >= 2)
    monitor.stop()
    assert set(killed) == {"e1"} and monitor.killed == len(killed)
    assert checked.count("e2") >= 2 and "e3" not in checked  # e3 is starting again
    waiting = HealthMonitor(engines, 0.01, 2.0, 60.0, check=check, kill=killed.append)
    with waiting.active():
        time.sleep(0.1)
    waiting.stop()
    assert waiting.killed == 0  # --rollout-health-check-first-wait not over


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--rollout-health-check-interval", "0", "interval must be positive, got 0.0"),
        ("--rollout-health-check-timeout", "-1", "timeout must be positive, got -1.0"),
        ("--rollout-health-check-first-wait", "-5", "first-wait must be >= 0, got -5.0"),
    ],
)
def test_health_check_flags_are_checked(flag, value, needle, capsys):
    from specrl.train_options import parse_args

    argv = base_args("m", "d.jsonl", "out") + [flag, value]
    with pytest.raises(SystemExit, match=needle):
        parse_args(argv)


def test_a_killed_and_a_hung_engine_are_restarted_and_the_run_completes(rollout_only_run):
    """--debug-rollout-only, one engine, --use-fault-tolerance with health checks (the shared run
    of tests/conftest.py). Rollout 0: the engine's actor is killed mid-request and the router
    restarts it. Rollout 1: its process is stopped (SIGSTOP: hung, not dead) mid-request; the
    health check kills it and the router restarts it. Rollout 2: nothing fails, nothing is
    redone."""
    proc, out = rollout_only_run
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    assert [r["rollout/engine_restarts"] for r in rows] == [1, 1, 0]
    redone = [r["rollout/requests_redone"] for r in rows]
    assert redone[0] >= 1 and redone[1] >= 1 and redone[2] == 0, redone
    assert all(r["rollout/raw_reward"] is not None for r in rows)
    # Rollout 0: the router notices the dead actor on its request; rollout 1: the health check
    # notices the hung one (it answers nothing, so no request fails before the check kills it),
    # then the router restarts it.
    lines = proc.stderr.splitlines()
    died = [
        i for i, line in enumerate(lines) if "engine 0 died (" in line and "restarting it" in line
    ]
    hung = "engine 0 is hung (no answer to a one-token generation within 2.0 s)"
    hung_at = [i for i, line in enumerate(lines) if hung in line]
    assert len(died) == 2 and hung_at and died[0] < hung_at[0] < died[1], proc.stderr[-3000:]
    assert proc.stderr.count("engine 0 restarted in") == 2, proc.stderr[-3000:]
    assert "2 restart(s) left (--max-engine-restarts 3)" in proc.stderr
    assert "1 restart(s) left (--max-engine-restarts 3)" in proc.stderr


@pytest.mark.parametrize(
    "error,flags,what",
    [
        (
            EngineDied(0, "killed"),
            [],
            "engine 0 died (killed) (add --use-fault-tolerance to restart dead engines)",
        ),
        (
            EngineRestartsExhausted("engine 1 died (killed), and the run has used its 0"),
            ["--use-fault-tolerance", "--max-engine-restarts", "0"],
            "engine 1 died (killed), and the run has used its 0",
        ),
    ],
)
def test_a_fatal_actor_death_exits_non_zero_naming_the_checkpoint(
    error, flags, what, rl_task, tmp_path, monkeypatch
):
    """What main() makes of an actor death that train() reports (the Ray side of it is the
    killed-engine run above and the dead-rank test)."""
    import specrl.loop

    def dies(args, resume):
        raise error

    monkeypatch.setattr(specrl.loop, "train", dies)
    for name in ("setup_logging", "quiet_known_noise"):  # keep pytest's logging as it is
        monkeypatch.setattr(specrl.loop, name, lambda: None)
    model, data = rl_task
    argv = base_args(model, data, str(tmp_path)) + ["--debug-rollout-only", *flags]
    with pytest.raises(SystemExit) as exit_:
        specrl.loop.main(argv)
    assert str(exit_.value) == (
        f"error: {what}; no checkpoint was saved (--save not set): a rerun starts from "
        "--hf-checkpoint"
    )
