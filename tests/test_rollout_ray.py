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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
