"""Trainer -> engine weight push: every path lands (outputs equal a fresh engine on the new
weights, checksums equal what was sent), MTP layers included, and a push that does not land
is caught by --check-weight-update-equal."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from spec_engine import Engine
from spec_engine.distributed.parallel_state import TPGroup
from spec_engine.weights.loader import tensor_checksum
from tests.conftest import random_prompts
from tiny.checkpoints import add_mimo_mtp
from trainer_bridge import weight_sync
from trainer_bridge.weight_sync import (
    ColocatedPlan,
    WeightPusher,
    WeightSyncConfig,
    buckets,
    share_colocated,
)

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = random_prompts(3, 4, 20, seed=11)


def tensors_of(path):
    return load_file(os.path.join(path, "model.safetensors"))


def outputs(engine):
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def mimo_pair(make_model):
    return (
        add_mimo_mtp(make_model("qwen2", num_layers=2, seed=21), seed=22),
        add_mimo_mtp(make_model("qwen2", num_layers=2, seed=23), seed=24),
    )


def test_buckets_respect_the_size_and_keep_order():
    items = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]
    groups = list(buckets(items, max_bytes=80))
    assert [[n for n, _ in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_push_lands_in_every_engine_with_mtp_layers(mimo_pair, mode, tmp_path):
    old, new = mimo_pair
    spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1)
    with Engine(model_path=new, random_seed=0, **spec) as fresh:
        expected = outputs(fresh)
    tensors = tensors_of(new)
    assert any(".mtp_layers." in n for n in tensors)
    engines = [Engine(model_path=old, random_seed=0, **spec) for _ in range(2)]
    try:
        assert outputs(engines[0]) != expected
        cfg = WeightSyncConfig(
            update_weight_buffer_size=200_000, weight_sync_mode=mode, check_weight_update_equal=True
        )
        pusher = WeightPusher(engines, cfg, output_dir=str(tmp_path))
        stats = pusher.push(tensors.items(), version="step-1")
        assert stats["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
        assert stats["buckets"] > 1 or mode == "disk"
        for engine in engines:
            assert outputs(engine) == expected
            assert engine.get_server_info()["weight_version"] == "step-1"
        # A second push over the same group (distributed) with other values lands as well.
        pusher.push(tensors_of(old).items(), version="step-2")
        assert engines[1].get_server_info()["weight_version"] == "step-2"
        pusher.close()
    finally:
        for engine in engines:
            engine.shutdown()


class DropsOne:
    """An engine wrapper that silently loses one tensor of every update (the bug to catch)."""

    def __init__(self, engine, name):
        self.engine, self.name = engine, name

    def __getattr__(self, attr):
        return getattr(self.engine, attr)

    def update_weights_from_tensor(self, named_tensors, **kwargs):
        from spec_engine.weights.transport import FlattenedBucket

        pairs = [
            p
            for b in named_tensors
            for p in FlattenedBucket.from_dict(b).unpack()
            if p[0] != self.name
        ]
        kwargs.pop("load_format")
        return self.engine.update_weights_from_tensor(pairs, **kwargs)


def test_check_weight_update_equal_fails_loudly(mimo_pair):
    old, new = mimo_pair
    name = "model.mtp_layers.0.input_proj.weight"
    with Engine(
        model_path=old,
        random_seed=0,
        speculative_algorithm="EAGLE",
        speculative_num_steps=2,
        speculative_eagle_topk=1,
    ) as engine:
        pusher = WeightPusher(
            [DropsOne(engine, name)], WeightSyncConfig(check_weight_update_equal=True)
        )
        with pytest.raises(
            RuntimeError, match="engine 0 holds different values for 1 of .*mtp_layers.0.input_proj"
        ):
            pusher.push(tensors_of(new).items(), version="v1")
        pusher.close()


def _push_from_trainer_ranks(engines, tensors, cfg, world, monkeypatch):
    """Push `tensors` colocated from a trainer of `world` ranks (threads of this process over a
    gloo group; rank 0 the pusher, the others share_colocated, each with its own copy); returns
    (each engine's serialized_named_tensors per call, the texts each trainer rank serialized)."""
    produced: dict[int, list[str]] = {rank: [] for rank in range(world)}
    ranks: dict[int, int] = {}  # thread -> trainer rank
    serialize = weight_sync.serialize_shared

    def recorded(payload):
        produced[ranks[threading.get_ident()]].append(serialize(payload))
        return produced[ranks[threading.get_ident()]][-1]

    monkeypatch.setattr(weight_sync, "serialize_shared", recorded)
    calls: list[list[list[str]]] = [[] for _ in engines]
    for engine, seen in zip(engines, calls):
        update = engine.update_weights_from_tensor

        def recording(update=update, seen=seen, **kwargs):
            seen.append(list(kwargs["serialized_named_tensors"]))
            return update(**kwargs)

        monkeypatch.setattr(engine, "update_weights_from_tensor", recording)
    store, errors = dist.HashStore(), []

    def trainer_rank(rank: int) -> None:
        ranks[threading.get_ident()] = rank
        try:
            group = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=30))
            trainer = TPGroup(rank, world, cpu_group=group)
            mine = {n: t.clone() for n, t in tensors.items()}
            if rank == 0:
                pusher = WeightPusher(engines, cfg, colocated=True, trainer=trainer)
                pusher.push(mine.items(), version="step-3")
                pusher.close()
            else:
                share_colocated(mine.items(), cfg, trainer)
        except BaseException as e:  # raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=trainer_rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return calls, produced


def test_an_engine_past_the_trainers_ranks_gets_rank_0s_copy():
    # Engines of 1 and 2 ranks on a trainer of 2: engine 0 on trainer rank 0, engine 1's ranks
    # on trainer ranks 1 and 2, of which there is none: rank 0's copy in both of its entries.
    plan = ColocatedPlan(block=None, sizes=(1, 2), world=2)
    assert plan.entries(["a", "b"]) == [["a"], ["a", "a"]]
    assert [plan.shares(r) for r in range(2)] == [True, False]
    plan = ColocatedPlan(block=None, sizes=(1, 2), world=3)
    assert plan.entries(["a", "b", "c"]) == [["a"], ["b", "c"]]
    assert [plan.shares(r) for r in range(3)] == [True, True, True]


def test_bad_config_is_refused():
    with pytest.raises(
        ValueError, match="--weight-sync-mode must be one of tensor, distributed, disk"
    ):
        WeightSyncConfig(weight_sync_mode="nccl")


def test_distributed_and_colocated_pushes_reach_every_rank_of_multi_rank_engines(
    make_model, monkeypatch
):
    """A tp-1 and a tp-2 engine in one group of 4 (the trainer, then each engine's ranks from
    its rank_offset: 1, then 2..3); the push lands on every rank, as the checksums gathered
    from the ranks confirm (--check-weight-update-equal). Then a colocated tensor push (one
    shared-memory entry per engine rank, SGLang's serialized_named_tensors) of the old weights
    back, on every rank too; then one from a trainer of three ranks (weight_sync.ColocatedPlan),
    each engine rank's entry from the trainer rank on its device."""
    old, new = make_model("qwen2", seed=31), make_model("qwen2", seed=32)
    small = dict(skip_tokenizer_init=True, max_total_tokens=256, log_level="warning")
    with Engine(model_path=new, **small) as fresh:
        expected = outputs(fresh)
    engines = [Engine(model_path=old, tp_size=size, **small) for size in (1, 2)]
    try:
        before = outputs(engines[0])
        cfg = WeightSyncConfig(weight_sync_mode="distributed", check_weight_update_equal=True)
        pusher = WeightPusher(engines, cfg)
        pusher.push(tensors_of(new).items(), version="step-1")
        assert [outputs(e) for e in engines] == [expected, expected]
        pusher.close()
        cfg = WeightSyncConfig(update_weight_buffer_size=50_000, check_weight_update_equal=True)
        pusher = WeightPusher(engines, cfg, colocated=True)
        assert pusher.push(tensors_of(old).items(), version="step-2")["buckets"] > 1
        assert [outputs(e) for e in engines] == [before, before] != [expected, expected]
        assert [e.weight_version for e in engines] == ["step-2", "step-2"]
        pusher.close()
        # From a trainer of three ranks, slime's way: the engines' ranks sit on trainer ranks
        # 0 | 1, 2, and each engine rank's entry is the copy its trainer rank shared.
        calls, produced = _push_from_trainer_ranks(engines, tensors_of(new), cfg, 3, monkeypatch)
        assert len(calls[0]) == len(calls[1]) > 1  # one call per bucket
        for call in calls[0]:
            assert len(call) == 1 and call[0] in produced[0]
        for call in calls[1]:
            assert len(call) == 2 and call[0] in produced[1] and call[1] in produced[2]
        assert [outputs(e) for e in engines] == [expected, expected]
        sums = {n: tensor_checksum(t) for n, t in tensors_of(new).items()}
        assert [e.get_weights_checksum() for e in engines] == [sums, sums]
        assert [e.weight_version for e in engines] == ["step-3", "step-3"]
    finally:
        for engine in engines:
            engine.shutdown()
