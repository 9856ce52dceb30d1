"""bench/drift.py's bookkeeping: the task file extended for long runs, and which kept run
a longer run goes on from."""

from __future__ import annotations

import json
import os

from bench.drift import LATEST, extend_task, goes_on_from
from tiny.run_assets import TASK_PROMPTS


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().split()


def test_extending_the_task_in_steps_equals_extending_it_once(tmp_path):
    """Every line past the written task repeats the post-shift prompts in order, whether the file
    grew to 480 lines at once or through 360 (a 90-rollout run made 120 rollouts long)."""
    once, steps = tmp_path / "once.jsonl", tmp_path / "steps.jsonl"
    for path in (once, steps):
        path.write_text("".join(f"{i}\n" for i in range(TASK_PROMPTS)))
    assert extend_task(str(once), 480, drift_at=120) == 480 - TASK_PROMPTS
    assert extend_task(str(steps), 360, drift_at=120) == 104
    assert extend_task(str(steps), 480, drift_at=120) == 120
    assert extend_task(str(steps), 400, drift_at=120) == 0  # long enough already
    lines = _lines(str(once))
    assert lines == _lines(str(steps))
    period = TASK_PROMPTS - 120
    assert lines[TASK_PROMPTS:] == [str(120 + (j - 120) % period) for j in range(TASK_PROMPTS, 480)]


def _run(path, rows: list[dict], checkpoint: bool) -> str:
    os.makedirs(path / "ckpt")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if checkpoint:
        (path / "ckpt" / LATEST).write_text("9")
    return str(path)


def test_a_kept_run_goes_on_only_from_the_current_start(tmp_path):
    start = [{"step": i, "rollout_id": i, "rollout/raw_reward": i / 10} for i in range(3)]
    later = [{"step": i, "rollout_id": i, "rollout/raw_reward": 0.5} for i in range(3, 6)]
    shared = _run(tmp_path / "shared", start, checkpoint=True)
    assert goes_on_from(_run(tmp_path / "arm", start + later, True), shared, 3)
    assert not goes_on_from(_run(tmp_path / "no-ckpt", start + later, False), shared, 3)
    redone = [{**r, "rollout/raw_reward": 0.9} for r in start]  # the shared start was run again
    assert not goes_on_from(_run(tmp_path / "stale", redone + later, True), shared, 3)
    assert not goes_on_from(_run(tmp_path / "short", start[:2], True), shared, 3)
