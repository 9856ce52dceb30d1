"""--save / --load on CPU. The policy's checkpoint round-trips bitwise at TP 2 (two gloo ranks:
saved, loaded, trained on exactly as the policy that never stopped). A run on Ray killed with
SIGKILL (its whole session: launcher, Ray, engines, trainer ranks) during a rollout and again
during a save, then rerun with the same command, resumes from the last complete checkpoint, in
Megatron-LM's layout, with its weight version and its log intact, and ends with the same weights
and metrics, bit for bit, as a run never killed nor saved (tests/conftest.py's rl_loop_run).
Bad directories and partial, corrupt or foreign checkpoints are refused before Ray starts,
naming the path."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.adam import adam

from specrl import checkpoint as run_checkpoint
from specrl.plots import read_metrics
from tests.e2e.test_train_loop import NUM_ROLLOUT, base_args, loop_args
from tests.support.forkserver import Session

pytest.importorskip("ray")


def run_argv(model: str, data: str, out: str) -> list[str]:
    """The RL loop's config (test_train_loop.py's loop_args: TP 2 colocated, MTP speculation,
    the MTP layer trained online, batch-invariant engines, --save-hf every 2 rollouts) with
    slime's resume pattern: the same directory to --load and --save. The resumed engines are
    checked to hold the resumed weights (--check-weight-update-equal)."""
    save = os.path.join(out, "ckpt")
    return loop_args(model, data, out) + ["--save", save, "--load", save]


def launch(argv: list[str], log: str) -> Session:
    """scripts/train.py in a session of its own, so that killing the session kills the run."""
    return Session("scripts.train", argv, log, log)


def session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    return [int(p) for p, s in (line.split() for line in out.splitlines()) if int(s) == sid]


def kill(proc: Session) -> None:
    """SIGKILL the run's process group, as a crash or an OOM killer would."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def reap(sid: int) -> list[int]:
    """The processes of killed session `sid` still alive 30 s later (Ray workers put themselves
    in groups of their own and leave once their raylet is gone), after killing them so nothing
    outlives the test."""
    deadline = time.monotonic() + 30
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.5)
    lingering = session_pids(sid)
    for pid in lingering:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return lingering


def wait_for(proc: Session, ready, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}"
        if time.monotonic() > deadline:
            kill(proc)  # a run from the server left running would keep pytest from exiting
            raise AssertionError(f"no {what} after {timeout} s")
        time.sleep(0.05)


def logged(out: str) -> int:
    path = os.path.join(out, "metrics.jsonl")
    return len(open(path).read().splitlines()) if os.path.exists(path) else 0


def finish(argv: list[str], log: str) -> None:
    proc = launch(argv, log)
    try:
        code = proc.wait(timeout=400)
    except subprocess.TimeoutExpired:
        kill(proc)
        raise
    assert code == 0, open(log).read()[-3000:]


@pytest.fixture(scope="module")
def task(rl_task):
    return rl_task


@pytest.fixture(scope="module")
def killed_run(task, rl_loop_run, tmp_path_factory) -> str:
    """The output directory of a run killed during rollout 2, rerun and killed while saving
    rollout 3, then rerun to the end. The run it must end as (rl_loop_run: the same config
    without --save and --load, so saving is shown not to change a run either) runs meanwhile, in
    a session of its own, filling the time each launch spends waiting rather than computing."""
    out = str(tmp_path_factory.mktemp("killed") / "run")
    rl_loop_run.ray_started()
    kill_and_resume(run_argv(*task, out), out, os.path.join(os.path.dirname(out), "log.txt"))
    return out


@pytest.fixture(scope="module")
def uninterrupted_run(rl_loop_run) -> str:
    rl_loop_run.finished()
    return rl_loop_run.out


def kill_and_resume(argv: list[str], out: str, log: str) -> None:
    """A run killed during rollout 2, rerun and killed while saving rollout 3, then rerun to
    the end. Each rerun starts as soon as the killed launcher is gone, as a user's would; a
    thread meanwhile watches the killed session's other processes leave."""
    save = os.path.join(out, "ckpt")
    with ThreadPoolExecutor() as watchers:
        # Killed during rollout 2: rollout 1's checkpoint is complete (it is written before the
        # rollout's metrics line).
        proc = launch(argv, log)
        wait_for(proc, lambda: logged(out) >= 2, "rollout 1's metrics")
        kill(proc)
        killed = [watchers.submit(reap, proc.pid)]
        assert run_checkpoint.read_latest(save) == 1
        # Rerun: resumes after rollout 1 and is killed while saving rollout 3's checkpoint.
        proc = launch(argv, log)
        partial = run_checkpoint.iter_dir(save, 3) + run_checkpoint.PARTIAL
        wait_for(proc, lambda: os.path.isdir(partial), "a save of rollout 3")
        kill(proc)
        killed.append(watchers.submit(reap, proc.pid))
        assert run_checkpoint.read_latest(save) == 1, (
            "a killed save must leave the previous one latest"
        )
        # The same command once more: resumes after rollout 1 again and finishes.
        finish(argv, log)
    lingering = [pid for watcher in killed for pid in watcher.result()]
    with open(log, "a") as f:
        f.write(f"lingering: {lingering}\n")


def test_a_killed_and_resumed_run_ends_as_one_never_killed(killed_run, uninterrupted_run):
    """Item 2 of resuming: the same final weights (policy and online-trained MTP layer) and the
    same metrics for every rollout, bit for bit."""
    final = [
        load_file(os.path.join(o, "hf", "3", "model.safetensors"))
        for o in (killed_run, uninterrupted_run)
    ]
    assert final[0].keys() == final[1].keys() and any("mtp_layers" in k for k in final[0])
    assert [k for k in final[0] if not torch.equal(final[0][k], final[1][k])] == []

    def kept(row: dict) -> dict:  # timings differ between any two runs
        return {k: v for k, v in row.items() if not k.startswith("perf/") and "time" not in k}

    rows = [read_metrics(os.path.join(o, "metrics.jsonl")) for o in (killed_run, uninterrupted_run)]
    assert len(rows[0]) == len(rows[1]) == NUM_ROLLOUT
    for resumed, straight in zip(*rows):
        assert kept(resumed) == kept(straight), resumed["rollout_id"]


def test_killed_twice_then_rerun_resumes_from_the_last_complete_checkpoint(killed_run):
    out, save = killed_run, os.path.join(killed_run, "ckpt")
    text = open(os.path.join(os.path.dirname(out), "log.txt")).read()
    assert text.count("resuming from " + run_checkpoint.iter_dir(save, 1)) == 2, text[-3000:]
    assert "lingering: []" in text, "processes of a killed run outlived it by 30 s"

    # Megatron-LM's layout; the killed save's directory was replaced by the complete one.
    assert sorted(os.listdir(save)) == ["iter_0000001", "iter_0000003", run_checkpoint.LATEST_FILE]
    assert open(os.path.join(save, run_checkpoint.LATEST_FILE)).read() == "3"
    last = run_checkpoint.iter_dir(save, 3)
    assert len([f for f in os.listdir(last) if f.endswith(".distcp")]) >= 2  # both TP ranks'
    common = torch.load(os.path.join(last, "common.pt"), weights_only=True)
    assert common["iteration"] == 3 and common["specrl"]["tensor_model_parallel_size"] == 2
    with open(os.path.join(last, run_checkpoint.ROLLOUT_STATE)) as f:
        state = json.load(f)
    assert state["weight_version"] == NUM_ROLLOUT
    assert state["rollout"]["data_source"]["offset"] == NUM_ROLLOUT * 2  # 2 prompts a rollout
    hf = load_file(os.path.join(out, "hf", "3", "model.safetensors"))
    assert any("mtp_layers" in k for k in hf)  # the draft trained online is exported too

    # Nothing lost from the log: the killed runs' lines are still there; the lines that count
    # (the last per rollout id) cover every rollout once, generated by consecutive versions.
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert len(lines) > NUM_ROLLOUT and all("rollout_id" in line for line in lines)
    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["rollout_id"] for r in rows] == list(range(NUM_ROLLOUT))
    assert [r["rollout/weight_version"] for r in rows] == list(range(NUM_ROLLOUT))
    assert all(r["train/mtp_loss"] is not None and r["train/grad_norm"] > 0 for r in rows)


LR = 1e-3


def _tp_actor(model: str, tp: int, rank: int = 0, port: int | None = None):
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.options import TrainerArgs

    args = TrainerArgs(
        hf_checkpoint=model, lr=LR, enable_mtp_training=True, tensor_model_parallel_size=tp
    )
    return TrainActor(args, rank=rank, world_size=tp, master_port=port)


def _tp_batches():
    from trainer_bridge.batch import TrainBatch

    return [
        TrainBatch(
            [[5, 6, 7, 8, 9, 10 + i, 11, 12]] * 4,
            [5] * 4,
            [1.0, 0.0, 1.0, 0.0],
            n_samples_per_prompt=4,
        )
        for i in range(3)
    ]


def _train_on(actor, batches) -> tuple[list[dict], dict, dict]:
    """Metrics of a step on each batch, then this rank's state dict and the whole model's
    (Hugging Face) weights."""
    metrics = [{k: v for k, v in actor.train(b).items() if "perf/" not in k} for b in batches]
    local = {k: v for k, v in actor.gpt.state_dict().items() if torch.is_tensor(v)}
    return metrics, local, {k: v.clone() for k, v in actor.hf_named_tensors()}


def _tp_run(rank: int, tp: int, ports: list, model: str, out: str, loads: list, tag: str) -> None:
    """At `tp` ranks, a fresh policy per entry of `loads`: None takes one step and saves it as
    ckpt-tp{tp}, a name loads that checkpoint; each then takes two more steps (`_train_on`),
    saved as {tag}-rank{rank}.pt."""
    from trainer_bridge.megatron_compat import destroy_model_parallel

    batches = _tp_batches()
    results = []
    for i, name in enumerate(loads):
        actor = _tp_actor(model, tp, rank, ports[i])
        try:
            if name is None:
                actor.train(batches[0])
                directory = os.path.join(out, f"ckpt-tp{tp}")
                os.makedirs(directory, exist_ok=True)
                actor.save_checkpoint(directory, 0)
            else:
                assert actor.load_checkpoint(os.path.join(out, name)) == 0
            results.append(_train_on(actor, batches[1:]))
        finally:
            destroy_model_parallel()
    torch.save(results, os.path.join(out, f"{tag}-rank{rank}.pt"))


def test_a_policy_checkpoint_resumes_bitwise_and_at_another_tp_size(make_model, tmp_path):
    """A tiny MiMo (MTP layer trained) with a vocabulary megatron pads differently at TP 1 (384)
    and TP 2 (512), saved after one step at TP 1 (one process) and at TP 2 (two gloo ranks): at
    the same TP size a fresh policy loading it trains on bit for bit as the policy that never
    stopped; at the other size it takes the two steps the saving run took, up to float32 sums in
    another order. Adam amplifies those where a gradient is near zero (a few weights end up to
    0.75 LR apart, as far as TP 1 and TP 2 runs from the same start: 1.75 LR), so the weights are
    compared by their mean distance: measured 0.0053 LR; with Adam's moments lost on loading
    0.164 LR, with its step count lost 0.116 LR (both also break the same-TP round trip)."""
    from tests.support.forkserver import start_ranks
    from tests.trainer.test_moe_tp import _ports
    from tiny.checkpoints import add_mimo_mtp

    model = add_mimo_mtp(make_model("qwen2", num_layers=2, seed=41, vocab_size=300), seed=42)
    out = str(tmp_path)
    _tp_run(0, 1, _ports(2), model, out, [None, "ckpt-tp1"], "tp1")
    # The save (in this process) started no helper process: megatron's writer, left alone, starts
    # a spawn-context multiprocessing Manager (1-10 s of CPU per trainer rank) for its results.
    assert [p.name for p in multiprocessing.active_children() if "Manager" in p.name] == []
    runs = (2, _ports(3), model, out, [None, "ckpt-tp2", "ckpt-tp1"], "tp2")
    start_ranks(_tp_run, runs, 2)
    _tp_run(0, 1, _ports(1), model, out, ["ckpt-tp2"], "tp1-from-tp2")
    assert len(list((tmp_path / "ckpt-tp2").glob("*.distcp"))) >= 2
    tp1 = torch.load(tmp_path / "tp1-rank0.pt", weights_only=False)
    tp2 = [torch.load(tmp_path / f"tp2-rank{r}.pt", weights_only=False) for r in range(2)]
    (tp1_from_tp2,) = torch.load(tmp_path / "tp1-from-tp2-rank0.pt", weights_only=False)
    for runs in (tp1, *tp2):
        (metrics, local, _), (resumed_metrics, resumed_local, _) = runs[:2]
        assert resumed_metrics == metrics  # MTP loss included
        assert [k for k in local if not torch.equal(local[k], resumed_local[k])] == []
    for resumed, uninterrupted in ((tp2[0][2], tp1[0]), (tp1_from_tp2, tp2[0][0])):
        for got, want in zip(resumed[0], uninterrupted[0], strict=True):
            assert got.keys() == want.keys()
            for key, value in want.items():
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        weights, expected = resumed[2], uninterrupted[2]
        assert weights.keys() == expected.keys() and any("embed_tokens" in k for k in weights)
        distance = sum((weights[k] - expected[k]).abs().sum().item() for k in weights)
        assert distance / sum(w.numel() for w in weights.values()) < 0.03 * LR


class GroupStepAdam(torch.optim.Optimizer):
    """Adam that counts its steps per param group (`group["step"]`), as Transformer Engine's and
    Apex's FusedAdam (megatron's Adam wherever either is installed: GPU runs) do, not per
    parameter as torch's; the update itself is torch's (torch.optim.adam.adam)."""

    def __init__(self, params, lr, weight_decay, betas, eps, adam_w_mode=True):
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        super().__init__(params, {**defaults, "adam_w_mode": adam_w_mode})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:
                    self.state[p].update(exp_avg=torch.zeros_like(p))
                    self.state[p].update(exp_avg_sq=torch.zeros_like(p))
            adam(
                params,
                [p.grad for p in params],
                [self.state[p]["exp_avg"] for p in params],
                [self.state[p]["exp_avg_sq"] for p in params],
                [],
                # the count before this step: adam() adds the 1
                [torch.tensor(group["step"] - 1.0, device=p.device) for p in params],
                foreach=False,
                amsgrad=False,
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
                decoupled_weight_decay=group["adam_w_mode"],
            )


def test_a_fused_adams_step_count_resumes(make_model, tmp_path, monkeypatch):
    """With megatron's Adam counting steps per param group (GroupStepAdam in place of TE's
    FusedAdam), the checkpoint holds that count (1 after one step) and a fresh policy loading it
    continues it (Adam's bias correction): it trains on bit for bit as the policy that never
    stopped. Read from the parameters' state instead, the count was saved as 0 and the resumed
    steps differed."""
    import megatron.core.optimizer as megatron_optimizer

    from tests.trainer.test_moe_tp import _ports
    from tiny.checkpoints import add_mimo_mtp

    monkeypatch.setattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(megatron_optimizer, "Adam", GroupStepAdam)
    model = add_mimo_mtp(make_model("qwen2", num_layers=2, seed=41, vocab_size=300), seed=42)
    _tp_run(0, 1, _ports(2), model, str(tmp_path), [None, "ckpt-tp1"], "fused")
    common = torch.load(tmp_path / "ckpt-tp1" / "common.pt", weights_only=True)
    assert common["optimizer"]["state"]["common_step"].item() == 1.0
    (metrics, local, _), (resumed_metrics, resumed_local, _) = torch.load(
        tmp_path / "fused-rank0.pt", weights_only=False
    )
    assert resumed_metrics == metrics
    assert [k for k in local if not torch.equal(local[k], resumed_local[k])] == []


def resolve_args(argv: list[str]) -> argparse.Namespace:
    from specrl.train_options import parse_args

    return parse_args(argv)


def hf_config(model: str) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)


def refused(argv: list[str], config: dict) -> str:
    with pytest.raises(SystemExit) as e:
        run_checkpoint.resolve(resolve_args(argv), config)
    return str(e.value)


def test_bad_directories_and_checkpoints_are_refused_naming_the_path(task, killed_run, tmp_path):
    model, data = task
    config = hf_config(model)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    message = refused(base_args(model, data, str(blocker / "out")), config)
    assert f"--output-dir {blocker / 'out'} is not writable" in message
    base = base_args(model, data, str(tmp_path / "out"))
    assert f"--save {blocker}/ckpt is not writable" in refused(
        base + ["--save", str(blocker / "ckpt")], config
    )
    empty = tmp_path / "empty"
    assert f"--load {empty} holds no checkpoint" in refused(base + ["--load", str(empty)], config)
    # slime: with --ref-load, a --load with nothing to resume starts from --ref-load's weights
    with_ref = resolve_args(base + ["--load", str(empty), "--ref-load", model])
    assert run_checkpoint.resolve(with_ref, config) is None
    assert with_ref.options.trainer.ref_load == model

    # A copy of the reference run's checkpoints to break in several ways.
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(killed_run, "ckpt"), ckpt)
    load = base + ["--load", ckpt, "--tensor-model-parallel-size", "2"]
    resume = run_checkpoint.resolve(resolve_args(load), config)
    assert resume.rollout_id == 3 and resume.state["weight_version"] == NUM_ROLLOUT
    # another TP size resumes (test_a_policy_checkpoint_resumes_bitwise_and_at_another_tp_size)
    assert run_checkpoint.resolve(resolve_args(base + ["--load", ckpt]), config).rollout_id == 3
    other = {**config, "intermediate_size": config["intermediate_size"] * 2}
    assert "holds another model than --hf-checkpoint (intermediate_size" in refused(load, other)
    last = run_checkpoint.iter_dir(ckpt, 3)
    shard = os.path.join(last, sorted(f for f in os.listdir(last) if f.endswith(".distcp"))[0])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    assert f"{shard} is cut short" in refused(load, config)
    os.remove(os.path.join(last, "common.pt"))
    assert f"{last} is incomplete (no common.pt)" in refused(load, config)
    shutil.rmtree(last)
    assert f"names rollout 3, but {last} is missing" in refused(load, config)


def test_a_bad_load_fails_before_ray_starts(task, tmp_path, monkeypatch):
    """specrl.loop's main, called in-process: it raises the SystemExit whose message the
    command prints, and never reaches Ray."""
    import specrl.loop

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started before --load was checked")

    monkeypatch.setattr(specrl.loop, "init_ray", no_ray)
    for name in ("setup_logging", "quiet_known_noise"):  # keep pytest's logging as it is
        monkeypatch.setattr(specrl.loop, name, lambda: None)
    model, data = task
    argv = base_args(model, data, str(tmp_path / "out")) + ["--load", str(tmp_path / "nothing")]
    with pytest.raises(SystemExit) as refused:
        specrl.loop.main(argv)
    assert "holds no checkpoint" in str(refused.value)
