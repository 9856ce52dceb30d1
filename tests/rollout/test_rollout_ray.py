"""The rollout through an engine in a Ray actor (skipped when ray is not installed)."""

from __future__ import annotations

import json
import os
import time

import pytest
from transformers import AutoTokenizer

from rollout import RolloutArgs, RolloutManager, Status
from rollout.engine_actor import EngineActor, RayEngineHandle
from rollout.engine_group import EngineGroup
from spec_engine.args.engine_args import EngineArgs
from specrl.placement import reserve_bundles

ray = pytest.importorskip("ray")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ray_session():
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()


@pytest.mark.slow
def test_manager_through_ray_actor(ray_session, llama_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    data = tmp_path / "p.jsonl"
    data.write_text(
        "".join(json.dumps({"input": f"copy: {c}", "label": c}) + "\n" for c in "abcdefgh")
    )
    args = RolloutArgs(
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        prompt_data=str(data),
        label_key="label",
        rm_type="tiny",
        rollout_max_response_len=32,
        over_sampling_batch_size=6,
    )
    actor = (
        ray.remote(EngineActor)
        .options(num_cpus=1)
        .remote(model_path=llama_path, random_seed=0, max_running_requests=2)
    )
    handle = RayEngineHandle(actor)
    groups, metrics = RolloutManager(args, [handle], tokenizer).generate(0)
    assert [len(g) for g in groups] == [2, 2]
    for s in (s for g in groups for s in g):
        assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward in (0.0, 1.0)
        assert len(s.rollout_log_probs) == s.response_length == len(s.tokens) - s.prompt_length
    assert metrics["rollout/groups_submitted"] == 6 and metrics["rollout/groups_leftover"] == 4
    state = ray.get(actor.get_server_info.remote())["internal_states"][0]
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0
    ray.get(actor.shutdown.remote())


@pytest.mark.slow
def test_engine_group_serves_releases_and_survives_a_dead_engine(ray_session, llama_path, caplog):
    """One engine in its own placement bundle: up when built, memory released and resumed for a
    colocated trainer, and shutdown ends cleanly although the engine's actor died."""
    engines = EngineGroup(
        EngineArgs(model_path=llama_path, random_seed=0, max_running_requests=2),
        reserve_bundles(1, 1, "--rollout-num-gpus"),
    )
    engines.wait_until_up()
    assert len(engines.handles) == 1 and engines.handles[0].actor is engines.actors[0]
    engines.release_memory()
    engines.resume_memory()
    out = ray.get(
        engines.actors[0].async_generate.remote(
            input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "temperature": 0.0}
        )
    )
    assert len(out["output_ids"]) == 2
    ray.kill(engines.actors[0])
    with pytest.raises(ray.exceptions.RayActorError):  # ray.kill returns before the actor is gone
        for _ in range(300):
            ray.get(engines.actors[0].get_model_info.remote())
            time.sleep(0.1)
    engines.shutdown()
    assert "engine shutdown failed" in caplog.text


@pytest.mark.slow
def test_colocated_placement_and_shared_weight_push(ray_session, make_model):
    """--colocate: a trainer rank and an engine on one bundle (slime's 0.4 + 0.2 of its device),
    and the tensor-mode push shares its buckets with the engine's process (CUDA IPC on GPUs,
    shared memory here) instead of copying them through Ray; checksums prove they landed."""
    import argparse

    import torch

    from specrl.placement import create_placements
    from trainer_bridge.weight_sync import WeightPusher, WeightSyncConfig

    old, new = (
        make_model("llama", num_layers=2, seed=51),
        make_model("llama", num_layers=2, seed=52),
    )
    flags = dict(
        debug_train_only=False,
        debug_rollout_only=False,
        rollout_num_gpus=1,
        rollout_num_gpus_per_engine=1,
        actor_num_nodes=1,
        actor_num_gpus_per_node=1,
    )
    placements = create_placements(argparse.Namespace(colocate=True, **flags))
    (engine_opts,), (trainer_opts,) = placements.engines, placements.trainer
    same = [o["scheduling_strategy"] for o in (engine_opts, trainer_opts)]
    assert same[0].placement_group.id == same[1].placement_group.id
    assert same[0].placement_group_bundle_index == same[1].placement_group_bundle_index == 0
    assert (engine_opts["num_cpus"], trainer_opts["num_cpus"]) == (0.2, 0.4)  # CPU bundles here
    group = EngineGroup(EngineArgs(model_path=old, random_seed=0), placements.engines)
    try:
        group.wait_until_up()
        from safetensors.torch import load_file

        tensors = load_file(os.path.join(new, "model.safetensors"), device="cpu")
        cfg = WeightSyncConfig(update_weight_buffer_size=100_000, check_weight_update_equal=True)
        pusher = WeightPusher(group.actors, cfg, colocated=True)
        stats = pusher.push(tensors.items(), version="shared-1")
        pusher.close()
        assert stats["buckets"] > 1
        info = ray.get(group.actors[0].get_server_info.remote())
        assert info["weight_version"] == "shared-1"
        assert torch.multiprocessing.get_sharing_strategy() == "file_system"
    finally:
        group.shutdown()


@pytest.mark.slow
def test_an_engine_that_fails_to_start_is_reported_naming_its_rank(ray_session):
    """Ray's error for an actor that raised while starting is a traceback; the one line the
    router and the run's last words give names the rank that failed, not its first cause."""
    import asyncio

    from rollout.router import EngineDied
    from tests.support.dying_rank import EngineFailsToStart

    actor = ray.remote(EngineFailsToStart).options(num_cpus=0).remote()
    with pytest.raises(EngineDied) as died:
        asyncio.run(RayEngineHandle(actor, 3).get_server_info())
    assert str(died.value).startswith("engine 3 died (The actor died because of an error raised")
    assert str(died.value).endswith(
        "in its creation task: spec_engine.distributed.launch.RankFailed: tensor-parallel rank 1 "
        "failed to start:)"
    ), str(died.value)
