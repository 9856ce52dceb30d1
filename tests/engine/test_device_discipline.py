"""Device discipline, checked on CPU: the engine (every speculative algorithm, graph capture and
replay with the self-check, every weight-update path, release/resume) and a train step with its
weight push create no tensor on an implicit device and none as an implicit float64
(tests/support/device_guard.py says why this is what a first GPU run would trip over)."""

from __future__ import annotations

import threading

import pytest
import torch

from spec_engine import Engine
from spec_engine.weights.transport import FlattenedBucket
from tests.conftest import random_prompts
from tests.engine.test_speculative import CONFIGS, models, spec_args  # noqa: F401  (module fixture)
from tests.engine.test_weight_updates import broadcast_from_trainer
from tests.support.device_guard import DeviceGuard, guarded_engine_threads
from tests.trainer.test_actor import actor, mimo, rollout  # noqa: F401  (module fixtures)
from trainer_bridge.megatron_compat import free_port

PROMPTS = random_prompts(3, 5, 12, seed=41)
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 6, "ignore_eos": True}
GRAPHS = dict(cuda_graph_bs=[1, 2, 4], cuda_graph_self_check=True, max_running_requests=4)


def _exercise(engine: Engine) -> None:
    engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    engine.generate(
        input_ids=PROMPTS, sampling_params=SAMPLED, return_logprob=True, top_logprobs_num=2
    )


def test_the_guard_catches_an_implicit_device_and_float64():
    import numpy as np

    from spec_engine.runner import graph_capture

    guard = DeviceGuard()
    with guard:
        torch.zeros(3)  # from the test itself: not project code, not judged
        graph_capture.capture  # noqa: B018
    assert not guard.violations, "\n".join(guard.violations)
    code = compile(
        "import torch\nx = torch.zeros(2)\ny = torch.tensor(np.zeros(2))",
        graph_capture.__file__,
        "exec",
    )
    with guard:
        exec(code, {"np": np})
    assert [v.split(":")[0] for v in guard.violations] == [
        "implicit device",
        "implicit device",
        "implicit float64",
    ]


@pytest.mark.parametrize("name", ["plain", *CONFIGS])
def test_engine_names_every_device(models, name):  # noqa: F811
    path, kwargs = (models["target"], {}) if name == "plain" else spec_args(models, name)
    guard = DeviceGuard()
    with guarded_engine_threads(guard):
        with Engine(model_path=path, random_seed=0, **GRAPHS, **kwargs) as engine:
            _exercise(engine)
    assert not guard.violations, "\n".join(guard.violations)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("plain", "bfloat16"), ("mtp", "float32"), ("eagle-tree-paged", "bfloat16")],
)
def test_deterministic_inference_names_every_device(models, name, dtype):  # noqa: F811
    """--enable-deterministic-inference's own paths (row-blocked matmuls, explicit attention,
    SiLU from exp) under the guard, in both CPU dtypes."""
    path, kwargs = (models["target"], {}) if name == "plain" else spec_args(models, name)
    guard = DeviceGuard()
    with guarded_engine_threads(guard):
        with Engine(
            model_path=path,
            random_seed=0,
            dtype=dtype,
            enable_deterministic_inference=True,
            **GRAPHS,
            **kwargs,
        ) as engine:
            _exercise(engine)
    assert not guard.violations, "\n".join(guard.violations)


def test_weight_updates_and_memory_name_every_device(models, tmp_path):  # noqa: F811
    path, kwargs = spec_args(models, "eagle3-draft-vocab")
    guard = DeviceGuard()
    with guarded_engine_threads(guard):
        with Engine(model_path=path, random_seed=0, **GRAPHS, **kwargs) as engine:
            head = [("lm_head.weight", engine.runner.model.lm_head.weight.detach().clone())]
            engine.update_weights_from_tensor(head, weight_version="1")
            engine.update_weights_from_tensor(
                FlattenedBucket.pack(head), load_format="flattened_bucket"
            )
            engine.update_weights_from_disk(path)
            engine.update_weights_from_disk(
                kwargs["speculative_draft_model_path"], component="draft"
            )
            _distributed_update(engine, head)
            engine.get_weights_checksum()
            for mode in ("retract", "in_place", "abort"):
                engine.pause_generation(mode=mode)
                engine.continue_generation()
            engine.release_memory_occupation()
            engine.resume_memory_occupation()
            _exercise(engine)
    assert not guard.violations, "\n".join(guard.violations)


@pytest.mark.parametrize("name", ["eagle3-draft-vocab", "mtp", "standalone", "ngram"])
def test_bfloat16_engine_runs_on_cpu(models, name):  # noqa: F811
    """bfloat16, the CUDA default, run on CPU: a tensor left in float32 on the way into a bf16
    model (draft features, self-check inputs) fails here as it would on a GPU."""
    path, kwargs = spec_args(models, name)
    with Engine(model_path=path, random_seed=0, dtype="bfloat16", **GRAPHS, **kwargs) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=SAMPLED, return_logprob=True)
    for out in outs:
        assert len(out["output_ids"]) == SAMPLED["max_new_tokens"]
        assert all(lp <= 0.0 for lp, _, _ in out["meta_info"]["output_token_logprobs"])


def _distributed_update(engine: Engine, named: list[tuple[str, torch.Tensor]]) -> None:
    """A broadcast from a trainer rank 0 in this process (gloo), as in test_weight_updates."""
    port, ready = free_port(), threading.Event()
    tensors = dict(named)
    trainer = threading.Thread(target=broadcast_from_trainer, args=(port, tensors, ready))
    trainer.start()
    engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="weights", backend="gloo")
    ready.set()
    engine.update_weights_from_distributed(
        list(tensors),
        [str(t.dtype) for t in tensors.values()],
        [list(t.shape) for t in tensors.values()],
        group_name="weights",
    )
    trainer.join(timeout=60)


def test_train_step_and_push_name_every_device(actor, mimo):  # noqa: F811
    """A GRPO step with online MTP training, log-probs and a checked tensor-mode push into an
    engine, under the guard; the model is built on the device asked for (megatron puts only its
    parallel layers on the CUDA device by itself), and metric reductions run on the rank's
    device."""
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.model.provider import build_gpt_model
    from trainer_bridge.parallel.data import DataParallel
    from trainer_bridge.weight_sync import WeightSyncConfig

    meta = build_gpt_model(mimo, device=torch.device("meta"))
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert {b.device.type for b in meta.buffers()} <= {"meta"}
    tokens, lengths, logps = rollout(
        mimo, speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1
    )
    rewards = [float(t[-1] % 2) for t in tokens]
    batch = TrainBatch(tokens, lengths, rewards, rollout_log_probs=logps, n_samples_per_prompt=4)
    guard = DeviceGuard()
    spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1)
    with guarded_engine_threads(guard):
        actor.compute_log_probs(batch)
        actor.train(batch)
        with Engine(model_path=mimo, random_seed=0, **spec) as engine:
            actor.push_weights([engine], WeightSyncConfig(check_weight_update_equal=True), "1")
        reduced = []
        two_ranks = DataParallel(2, 0, actor.device)
        two_ranks.all_reduce = lambda t, op="sum": reduced.append(t)
        assert two_ranks.mean({"a": 1.0, "b": 3.0}) == {"a": 0.5, "b": 1.5}
        assert two_ranks.max(3) == 3
    assert [t.device for t in reduced] == [actor.device] * 2
    assert not guard.violations, "\n".join(guard.violations)


def test_self_check_tolerance_scales_with_the_outputs():
    """bfloat16 logits of a real model reach tens, where one bfloat16 step is 0.125: the bound
    grows with the magnitude (a fixed 5e-2 would fail every sound replay), float32 stays tight."""
    from spec_engine.runner.self_check import mismatch, self_check_tolerance

    want = torch.tensor([30.0, -2.0, 0.5], device="cpu")
    bf16 = self_check_tolerance(torch.bfloat16)
    err, bound = mismatch(want, want + torch.tensor([0.25, 0.0, 0.0], device="cpu"), bf16)
    assert err <= bound
    err, bound = mismatch(want, want + torch.tensor([0.0, 2.0, 0.0], device="cpu"), bf16)
    assert err > bound
    f32 = self_check_tolerance(torch.float32)
    err, bound = mismatch(want, want + torch.tensor([0.0, 0.0, 0.01], device="cpu"), f32)
    assert err > bound


def test_stage_times_mark_cuda_with_events_and_never_synchronize_a_step(monkeypatch):
    """Speculative stage timings on CUDA (kernels run asynchronously): each boundary records an
    event, a stage's seconds are collected once its end event completed (query), nothing waits
    for the device until the breakdown is asked for; `elapsed` (the adaptive catch-up estimate)
    waits for its end. On CPU the host clock."""
    from spec_engine.speculative import stage_times

    clock = iter(range(100))

    class Event:  # CUDA's event API on a fake device clock: one tick per record
        def __init__(self) -> None:
            self.at, self.done, self.waited = next(clock), False, False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = self.waited = True

        def elapsed_time(self, end: Event) -> float:
            assert end.done, "elapsed_time of an event still running"
            return 1e3 * (end.at - self.at)  # milliseconds

    events = []
    monkeypatch.setattr(stage_times, "_event", lambda: events.append(Event()) or events[-1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synchronize"))
    times = stage_times.StageTimes(torch.device("cuda", 0))
    start = times.now()
    mid = times.add("draft_s", start)
    end = times.add("verify_s", mid)
    assert not any(e.waited for e in events)
    events[1].done = True  # the draft ran, the verify still runs: only the draft is counted
    times.add("bookkeeping_s", times.now())
    assert times._seconds == {"draft_s": 1.0, "verify_s": 0.0, "bookkeeping_s": 0.0}
    assert not any(e.waited for e in events)
    assert times.elapsed(mid, end) == 1.0 and end.waited
    assert times.seconds == {"draft_s": 1.0, "verify_s": 1.0, "bookkeeping_s": 1.0}
    cpu = stage_times.StageTimes(torch.device("cpu"))
    cpu.add("draft_s", cpu.now())
    assert len(events) == 5 and cpu.seconds["draft_s"] >= 0


def test_ray_workers_keep_the_callers_pythonpath():
    """Ray's runtime env replaces PYTHONPATH: packages installed with `pip --target` (on the
    caller's PYTHONPATH) must stay visible to the workers, after this checkout."""
    from specrl.placement import worker_pythonpath

    env = {"PYTHONPATH": "/opt/pkgs:/repo"}
    assert worker_pythonpath("/repo", env) == "/repo:/opt/pkgs"
    assert worker_pythonpath("/repo", {}) == "/repo"
