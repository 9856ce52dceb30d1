"""scripts/train_async.py on CPU (a local Ray, an engine and a trainer rank on devices of their
own): rollout N+1 is generated while the trainer trains on N, the weights pushed every
--update-weights-interval steps bound the staleness of the trained tokens, every group is
trained once, and a run resumed from a checkpoint generates and trains as one never stopped."""

from __future__ import annotations

import os
import shutil

import pytest

from rollout.debug_data import load_debug_rollout_data
from specrl import checkpoint as run_checkpoint
from tests.e2e.test_train_loop import base_args, metrics, run

pytest.importorskip("ray")

NUM_ROLLOUT = 4
INTERVAL = 2  # --update-weights-interval: pushes after rollouts 1 and 3
MAIN = "from specrl.async_loop import main; main(sys.argv[1:])"


def async_args(model: str, data: str, out: str, save: bool = True) -> list[str]:
    """Responses of up to 24 tokens (stopping on a tenth of the vocabulary spreads their
    lengths), so that a rollout outlasts the start of the train step beside it; batch-invariant
    engines, so that a resumed run samples what the uninterrupted one did; a checkpoint every
    --update-weights-interval rollouts unless `save` is False."""
    argv = base_args(model, data, out) + ["--lr", "1e-3", "--rollout-stop-token-ids"]
    argv += [str(t) for t in range(100, 150)]
    argv += ["--update-weights-interval", str(INTERVAL), "--sglang-enable-deterministic-inference"]
    argv += ["--save-interval", str(INTERVAL)]
    if save:
        argv += ["--save", os.path.join(out, "ckpt")]
    argv += ["--save-debug-rollout-data", os.path.join(out, "rollouts", "r{rollout_id}.pt")]
    argv[argv.index("--rollout-max-response-len") + 1] = "24"
    argv[argv.index("--num-rollout") + 1] = str(NUM_ROLLOUT)
    return argv


@pytest.fixture(scope="module")
def runs(rl_task, tmp_path_factory) -> tuple[str, str]:
    """(an uninterrupted run, a run resumed from its checkpoint after rollout 1): the state a run
    killed during rollout 2 leaves (rollout 2 was generated before the save, and is in it). The
    resumed run is launched without --save: what it generates must not depend on saving."""
    model, data = rl_task
    root = tmp_path_factory.mktemp("async")
    straight, resumed = str(root / "straight"), str(root / "resumed")
    run(async_args(model, data, straight), code=MAIN)
    ckpt = checkpoint_1(straight, os.path.join(resumed, "ckpt"))
    run(async_args(model, data, resumed, save=False) + ["--load", ckpt], code=MAIN)
    return straight, resumed


def checkpoint_1(out: str, save: str) -> str:
    """A --save directory holding `out`'s checkpoint after rollout 1 as its latest."""
    source = run_checkpoint.iter_dir(os.path.join(out, "ckpt"), 1)
    shutil.copytree(source, run_checkpoint.iter_dir(save, 1))
    with open(os.path.join(save, run_checkpoint.LATEST_FILE), "w") as f:
        f.write("1")
    return save


def test_rollouts_overlap_training_within_the_staleness_bound(runs):
    out = runs[0]
    rows = metrics(out)
    assert [r["rollout_id"] for r in rows] == list(range(NUM_ROLLOUT))
    for n in range(NUM_ROLLOUT - 1):
        # rollout n+1 was started before train step n and still ran when it began
        trained, ahead = rows[n], rows[n + 1]
        assert ahead["perf/rollout_started_at"] < trained["perf/train_started_at"]
        assert trained["perf/train_started_at"] < ahead["perf/rollout_finished_at"], n
    # Pushed after rollouts 1 and 3: rollouts 1 and 2 come from version 0, rollout 3 from 2.
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 0, 2]
    lags = [r["rollout/weight_version_lag/max"] for r in rows]
    assert lags == [0, 1, 2, 1] and max(lags) <= INTERVAL
    assert [r["rollout/weight_version_lag/mean"] for r in rows] == lags  # one version a rollout
    assert ["perf/update_weights_time" in r for r in rows] == [False, True, False, True]
    saved = os.path.join(out, "rollouts", "r{rollout_id}.pt")
    groups = [g for i in range(NUM_ROLLOUT) for g in load_debug_rollout_data(saved, i)]
    trained = [g[0].group_index for g in groups]
    assert len(trained) == len(set(trained)) == 2 * NUM_ROLLOUT  # none lost, none twice
    assert os.path.exists(os.path.join(out, "plots", "reward.svg"))


def test_a_resumed_run_generates_and_trains_as_one_never_stopped(runs):
    straight, resumed = runs

    def kept(row: dict) -> dict:  # timings differ between any two runs
        return {k: v for k, v in row.items() if not k.startswith("perf/") and "time" not in k}

    rows = [metrics(o) for o in runs]
    assert [r["rollout_id"] for r in rows[1]] == [2, 3]
    for resumed_row, straight_row in zip(rows[1], rows[0][2:]):
        assert kept(resumed_row) == kept(straight_row)
    # rollout 2 came from the checkpoint; rollout 3 is generated again, from the same weights
    a, b = (
        load_debug_rollout_data(os.path.join(o, "rollouts", "r{rollout_id}.pt"), 3)
        for o in (straight, resumed)
    )
    assert [[s.tokens for s in g] for g in a] == [[s.tokens for s in g] for g in b]
    assert not os.path.exists(os.path.join(resumed, "rollouts", "r2.pt"))


def test_scripts_train_refuses_a_checkpoint_holding_a_rollout(rl_task, tmp_path, runs):
    from specrl.loop import main

    ckpt = checkpoint_1(runs[0], str(tmp_path / "ckpt"))
    argv = base_args(*rl_task, str(tmp_path / "x")) + ["--dry-run", "--load", ckpt]
    with pytest.raises(SystemExit, match="with rollout 2 already generated; .*train_async.py"):
        main(argv)


def test_refusals(rl_task, tmp_path):
    """--colocate (and an interval scripts/train.py cannot honour) are refused before Ray
    starts, naming the reason and the command to run."""
    from specrl.async_loop import main as main_async
    from specrl.loop import main

    argv = base_args(*rl_task, str(tmp_path / "x")) + ["--dry-run"]  # a missed refusal stops
    with pytest.raises(SystemExit, match="--colocate: .* run scripts/train.py to colocate"):
        main_async(argv + ["--colocate"])
    with pytest.raises(SystemExit, match="--update-weights-interval 2: .*train_async.py"):
        main(argv + ["--update-weights-interval", "2"])
    with pytest.raises(SystemExit, match="not a multiple of --update-weights-interval 2"):
        main_async(argv + ["--update-weights-interval", "2", "--save-interval", "3"])
