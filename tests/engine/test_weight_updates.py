"""Weight updates into target and draft (tensor, bucket, IPC handle, broadcast, disk), pause
modes, flush, release/resume, checksums, and refusal of bad updates."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from spec_engine import Engine
from spec_engine.weights.loader import tensor_checksum
from spec_engine.weights.transport import FlattenedBucket
from tests.conftest import random_prompts
from tiny.checkpoints import add_mimo_mtp
from trainer_bridge.megatron_compat import free_port

GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
PROMPTS = random_prompts(4, 3, 30, seed=40)


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def pair(make_model):
    """Two checkpoints of one architecture with different weights (old, new)."""
    return make_model("llama", num_layers=2, seed=1), make_model("llama", num_layers=2, seed=2)


@pytest.fixture(scope="module")
def mimo_pair(make_model):
    return add_mimo_mtp(make_model("qwen2", num_layers=2, seed=3), seed=4), add_mimo_mtp(
        make_model("qwen2", num_layers=2, seed=5), seed=6
    )


def outputs(engine: Engine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


def fresh_outputs(path: str, **kwargs) -> list[list[int]]:
    with Engine(model_path=path, random_seed=0, **kwargs) as engine:
        return outputs(engine)


def broadcast_from_trainer(
    port: int, tensors: dict[str, torch.Tensor], ready: threading.Event
) -> None:
    """The trainer side: rank 0 of a two-rank gloo group, broadcasting each tensor in order."""
    store = dist.PrefixStore(
        "weights",
        dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60)),
    )
    group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=60))
    ready.wait(60)
    for tensor in tensors.values():
        group.broadcast(tensor, 0).wait()


def ipc_handles(tensors: dict[str, torch.Tensor]) -> list:
    from torch.multiprocessing.reductions import reduce_tensor

    return [(name, reduce_tensor(t.share_memory_())) for name, t in tensors.items()]


@pytest.mark.parametrize("path_kind", ["tensor", "bucket", "ipc", "distributed", "disk"])
def test_each_update_path_gives_the_new_models_outputs(pair, path_kind):
    old, new = pair
    expected = fresh_outputs(new)
    tensors = checkpoint_tensors(new)
    with Engine(model_path=old, random_seed=0) as engine:
        before = outputs(engine)
        assert before != expected
        if path_kind == "tensor":
            result = engine.update_weights_from_tensor(list(tensors.items()), weight_version="v2")
        elif path_kind == "bucket":
            buckets = FlattenedBucket.pack(tensors.items())
            result = engine.update_weights_from_tensor(
                [b.to_dict() for b in buckets], load_format="flattened_bucket", weight_version="v2"
            )
        elif path_kind == "ipc":
            result = engine.update_weights_from_tensor(ipc_handles(tensors), weight_version="v2")
        elif path_kind == "distributed":
            port, ready = free_port(), threading.Event()
            trainer = threading.Thread(target=broadcast_from_trainer, args=(port, tensors, ready))
            trainer.start()
            engine.init_weights_update_group(
                "127.0.0.1", port, 1, 2, group_name="weights", backend="gloo"
            )
            # Refused before any broadcast is taken, so the trainer's next ones stay in step.
            with pytest.raises(ValueError, match="unknown dtype 'bogus'"):
                engine.update_weights_from_distributed(
                    ["model.norm.weight", "lm_head.weight"],
                    ["float32", "bogus"],
                    [[64], [512, 64]],
                    group_name="weights",
                )
            ready.set()
            result = engine.update_weights_from_distributed(
                list(tensors),
                [str(t.dtype) for t in tensors.values()],
                [list(t.shape) for t in tensors.values()],
                group_name="weights",
                weight_version="v2",
            )
            trainer.join()
        else:
            result = engine.update_weights_from_disk(new, weight_version="v2")
        assert result["success"] and result["bytes"] == sum(
            t.numel() * t.element_size() for t in tensors.values()
        )
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in out] == expected
        assert all(o["meta_info"]["weight_version"] == "v2" for o in out)
        assert engine.get_server_info()["weight_version"] == "v2"
        sums = engine.get_weights_checksum()
        assert sums == {n: tensor_checksum(t) for n, t in tensors.items()}


def test_mtp_draft_layers_are_updated_with_the_target(mimo_pair):
    old, new = mimo_pair
    spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1)
    tensors = checkpoint_tensors(new)
    with Engine(model_path=new, random_seed=0, **spec) as engine:
        expected = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    with Engine(model_path=old, random_seed=0, **spec) as engine:
        engine.update_weights_from_tensor(list(tensors.items()))
        got = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        sums = engine.get_weights_checksum([n for n in tensors if ".mtp_layers.0." in n])
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert sums == {n: tensor_checksum(tensors[n]) for n in sums} and len(sums) > 10
    for g, e in zip(got, expected):
        assert g["meta_info"]["spec_verify_ct"] == e["meta_info"]["spec_verify_ct"]


def test_external_draft_is_updated_by_prefix_and_from_disk(pair, tmp_path):
    from tiny.checkpoints import build_eagle_draft

    old, new = pair
    d_old = build_eagle_draft(str(tmp_path / "d_old"), old, version=2, seed=1)
    d_new = build_eagle_draft(str(tmp_path / "d_new"), old, version=2, seed=2)
    spec = dict(
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=d_old,
        speculative_num_steps=2,
        speculative_eagle_topk=1,
    )
    new_draft = {
        k: v for k, v in checkpoint_tensors(d_new).items() if k.startswith(("fc.", "layers."))
    }
    with Engine(model_path=old, random_seed=0, **spec) as engine:
        engine.update_weights_from_tensor([("draft." + n, t) for n, t in new_draft.items()])
        sums = engine.get_weights_checksum(["draft." + n for n in new_draft])
        assert sums == {"draft." + n: tensor_checksum(t) for n, t in new_draft.items()}
        engine.update_weights_from_disk(d_old, component="draft")
        assert engine.get_weights_checksum(["draft.fc.weight"])[
            "draft.fc.weight"
        ] == tensor_checksum(checkpoint_tensors(d_old)["fc.weight"])
        with pytest.raises(ValueError, match="unknown weight 'fc.weight'"):
            engine.update_weights_from_tensor([("fc.weight", new_draft["fc.weight"])])


def test_self_draft_survives_ten_release_resume_cycles(pair):
    path = pair[0]
    steps = 3
    params = {**GREEDY, "max_new_tokens": 1 + 3 * (steps + 1)}
    with Engine(
        model_path=path,
        random_seed=0,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=path,
        speculative_num_steps=steps,
        speculative_eagle_topk=1,
    ) as engine:
        first = engine.generate(input_ids=PROMPTS, sampling_params=params)
        sums = engine.get_weights_checksum()
        for _ in range(10):
            engine.release_memory_occupation()
            assert engine.runner.model.lm_head.weight.numel() == 0
            assert engine.scheduler.worker.draft.model.lm_head.weight.numel() == 0
            engine.resume_memory_occupation()
            again = engine.generate(input_ids=PROMPTS, sampling_params=params)
            assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]
            assert all(o["meta_info"]["spec_accept_length"] == steps + 1 for o in again)
        assert engine.get_weights_checksum() == sums


def test_requests_wait_while_memory_is_released(pair):
    with Engine(model_path=pair[0], random_seed=0) as engine:
        expected = outputs(engine)
        engine.release_memory_occupation(["weights", "kv_cache"])
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("out", outputs(engine)))
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and "out" not in result
        engine.resume_memory_occupation(["weights", "kv_cache"])
        t.join(60)
        assert result["out"] == expected
        with pytest.raises(ValueError, match="unknown memory tags"):
            engine.release_memory_occupation(["gpu"])


def run_in_background(engine, params):
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault(
            "out", engine.generate(input_ids=PROMPTS, sampling_params=params)
        )
    )
    t.start()
    deadline = time.time() + 30
    while len(engine.scheduler.running) < len(PROMPTS) and time.time() < deadline:
        time.sleep(0.001)
    return t, result


def test_pause_retract_update_continue_finishes_on_new_weights(pair):
    old, new = pair
    params = {**GREEDY, "max_new_tokens": 150}
    with Engine(model_path=old, random_seed=0) as engine:
        t, result = run_in_background(engine, params)
        engine.pause_generation(mode="retract")
        partial = engine._call(
            lambda: {r.input.rid: list(r.output_ids) for r in engine.scheduler.admission.waiting}
        )
        assert len(partial) == len(PROMPTS) and engine.scheduler.running == []
        engine.update_weights_from_disk(new)
        engine.continue_generation()
        t.join(60)
        out = result["out"]
    assert all(len(o["output_ids"]) == 150 for o in out)
    with Engine(model_path=new, random_seed=0) as fresh:
        for prompt, o in zip(PROMPTS, out):
            done = partial[o["meta_info"]["id"]]
            assert o["output_ids"][: len(done)] == done
            rest = fresh.generate(
                input_ids=prompt + done,
                sampling_params={**GREEDY, "max_new_tokens": 150 - len(done)},
            )
            assert o["output_ids"][len(done) :] == rest["output_ids"]


def test_pause_abort_and_in_place(pair):
    old, new = pair
    params = {**GREEDY, "max_new_tokens": 150}
    with Engine(model_path=old, random_seed=0) as engine:
        t, result = run_in_background(engine, params)
        engine.pause_generation(mode="abort")
        t.join(30)
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in result["out"])
        engine.continue_generation()
        prefills = []
        prefill = engine.scheduler.worker.prefill
        engine.scheduler.worker.prefill = lambda reqs: prefills.append(len(reqs)) or prefill(reqs)
        t, result = run_in_background(engine, params)
        admitted = len(prefills)
        engine.pause_generation(mode="in_place")
        assert engine.flush_cache()  # allowed while paused; running requests keep their KV
        engine.update_weights_from_disk(new)
        engine.continue_generation()
        t.join(60)
        assert all(len(o["output_ids"]) == 150 for o in result["out"])
        assert len(prefills) == admitted  # nothing was recomputed
        report = engine.scheduler.memory_report()
        assert report["free"] + report["cached"] == report["total"]
        # KV computed before the update (the prompts' among it) is never served afterwards.
        again = engine.generate(input_ids=PROMPTS, sampling_params={**GREEDY, "max_new_tokens": 2})
        assert [o["meta_info"]["cached_tokens"] for o in again] == [0] * len(PROMPTS)


def test_flush_cache_is_refused_while_requests_run(pair):
    with Engine(model_path=pair[0], random_seed=0) as engine:
        t, _ = run_in_background(engine, {**GREEDY, "max_new_tokens": 150})
        assert engine.flush_cache() is False
        t.join(60)
        assert engine.flush_cache() is True


@pytest.mark.parametrize(
    "bad,needle",
    [
        ("unknown", "unknown weight 'model.layers.9.mlp.up_proj.weight'"),
        ("shape", "has shape"),
        ("dtype", "floating-point"),
        ("truncated", "truncated bucket"),
        ("meta", "meta tensor"),
    ],
)
def test_bad_updates_are_refused_and_change_nothing(pair, bad, needle):
    old, new = pair
    tensors = checkpoint_tensors(new)
    with Engine(model_path=old, random_seed=0) as engine:
        before, sums = outputs(engine), engine.get_weights_checksum()
        items = list(tensors.items())
        if bad == "unknown":
            items.append(
                ("model.layers.9.mlp.up_proj.weight", tensors["model.layers.0.mlp.up_proj.weight"])
            )
        elif bad == "shape":
            items.append(("model.layers.1.mlp.up_proj.weight", torch.zeros(3, 3)))
        elif bad == "dtype":
            items.append(("model.norm.weight", torch.ones(64, dtype=torch.int32)))
        elif bad == "meta":
            items.append(("model.norm.weight", torch.empty(64, device="meta")))
        with pytest.raises(ValueError, match=needle):
            if bad == "truncated":
                bucket = FlattenedBucket.pack(items)[0].to_dict()
                bucket["flattened_tensor"] = bucket["flattened_tensor"][:-10]
                engine.update_weights_from_tensor(bucket, load_format="flattened_bucket")
            else:
                engine.update_weights_from_tensor(items)
        assert engine.get_weights_checksum() == sums
        assert outputs(engine) == before


def test_http_weight_and_memory_endpoints(pair):
    from fastapi.testclient import TestClient

    from spec_engine.server.http_server import create_app
    from spec_engine.weights.transport import serialize_tensors

    old, new = pair
    tensors = checkpoint_tensors(new)
    expected = fresh_outputs(new)
    with Engine(model_path=old, random_seed=0) as engine:
        client = TestClient(create_app(engine))
        bad = client.post(
            "/update_weights_from_tensor",
            json={
                "serialized_named_tensors": serialize_tensors(
                    [("model.norm.weight", torch.zeros(5))]
                )
            },
        )
        assert bad.status_code == 400 and "model.norm.weight" in bad.json()["error"]["message"]
        assert (
            client.post(
                "/update_weights_from_tensor", json={"serialized_named_tensors": "%%%"}
            ).status_code
            == 400
        )
        assert client.post("/update_weights_from_disk", json={}).status_code == 400
        assert client.post("/pause_generation", json={"mode": "sideways"}).status_code == 400
        for path, body in (
            ("/update_weights_from_disk", {"model_path": "/nonexistent"}),
            ("/update_weights_from_disk", {"model_path": 123}),
            ("/update_weights_from_tensor", {"serialized_named_tensors": serialize_tensors(5)}),
            (
                "/update_weights_from_tensor",
                {"serialized_named_tensors": serialize_tensors([torch.ones(2)])},
            ),
            (
                "/update_weights_from_tensor",
                {
                    "load_format": "flattened_bucket",
                    "serialized_named_tensors": serialize_tensors(
                        [
                            {
                                "flattened_tensor": torch.ones(4),
                                "metadata": [
                                    {
                                        "name": "model.norm.weight",
                                        "shape": [-8, -8],
                                        "start_idx": 0,
                                        "end_idx": 64,
                                    }
                                ],
                            }
                        ]
                    ),
                },
            ),
            ("/get_weights_checksum", {"names": [["x"]]}),
            ("/get_weights_checksum", {"names": 5}),
            ("/release_memory_occupation", {"tags": 5}),
            (
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": "x",
                    "rank_offset": 1,
                    "world_size": 2,
                },
            ),
        ):
            r = client.post(path, json=body)
            assert r.status_code == 400, (path, body, r.status_code, r.text)
        ok = client.post(
            "/update_weights_from_tensor",
            json={
                "serialized_named_tensors": serialize_tensors(list(tensors.items())),
                "weight_version": "v7",
            },
        )
        assert ok.status_code == 200 and ok.json()["weight_version"] == "v7"
        assert outputs(engine) == expected
        sums = client.post("/get_weights_checksum", json={"names": ["model.norm.weight"]}).json()
        assert sums == {"model.norm.weight": tensor_checksum(tensors["model.norm.weight"])}
        assert (
            client.post(
                "/update_weights_from_disk", json={"model_path": old, "weight_version": "v8"}
            ).status_code
            == 200
        )
        for path, body in (
            ("/pause_generation", {"mode": "retract"}),
            ("/continue_generation", None),
            ("/release_memory_occupation", {"tags": ["weights"]}),
            ("/resume_memory_occupation", {"tags": ["weights"]}),
        ):
            r = client.post(path, json=body) if body is not None else client.post(path)
            assert r.status_code == 200, (path, r.text)
        assert outputs(engine) == fresh_outputs(old)
        assert engine.get_server_info()["weight_version"] == "v8"


def test_checkpoint_buffers_are_accepted_and_tied_conflicts_refused(pair, make_model):
    old, new = pair
    tensors = checkpoint_tensors(new)
    with Engine(model_path=old, random_seed=0) as engine:
        extra = [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(16))]
        assert engine.update_weights_from_tensor(list(tensors.items()) + extra)["success"]
        assert outputs(engine) == fresh_outputs(new)
        engine.release_memory_occupation(["weights"])
        with pytest.raises(ValueError, match="weights are released"):
            engine.get_weights_checksum()
        engine.resume_memory_occupation(["weights"])
    tied = make_model("qwen2", tie_word_embeddings=True)
    with Engine(model_path=tied, random_seed=0) as engine:
        embed = checkpoint_tensors(tied)["model.embed_tokens.weight"]
        sums = engine.get_weights_checksum()
        with pytest.raises(ValueError, match="tied"):
            engine.update_weights_from_tensor(
                [("model.embed_tokens.weight", embed), ("lm_head.weight", embed + 1)]
            )
        assert engine.get_weights_checksum() == sums
        assert engine.update_weights_from_tensor(
            [("model.embed_tokens.weight", embed), ("lm_head.weight", embed)]
        )["success"]


def test_bad_eagle3_id_map_is_refused_before_anything_changes(make_model, tmp_path):
    from tiny.checkpoints import build_eagle_draft

    target = make_model("llama", num_layers=4)
    draft = build_eagle_draft(str(tmp_path / "eagle3"), target, version=3, draft_vocab_size=128)
    kwargs = dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft,
        speculative_num_steps=2,
        speculative_eagle_topk=1,
    )
    with Engine(model_path=target, random_seed=0, **kwargs) as engine:
        before, sums = outputs(engine), engine.get_weights_checksum()
        d2t = load_file(os.path.join(draft, "model.safetensors"))["d2t"]
        norm = torch.zeros_like(checkpoint_tensors(target)["model.norm.weight"])
        repeated, outside = d2t.clone(), d2t.clone()
        repeated[1] = repeated[0] - 1  # draft id 1 -> the target token of draft id 0
        outside[-1] = 10_000
        for bad, needle in (
            (repeated, "two draft ids"),
            (outside, "outside the target vocabulary"),
            (d2t.bool(), "integer tensor"),
        ):
            with pytest.raises(ValueError, match=needle):
                engine.update_weights_from_tensor([("model.norm.weight", norm), ("draft.d2t", bad)])
            assert engine.get_weights_checksum() == sums
        assert outputs(engine) == before


def test_sglang_serialized_tensors_are_shared_and_nothing_else_unpickles(pair):
    """serialized_named_tensors in SGLang's MultiprocessingSerializer form (what slime sends):
    the engine opens the shared tensors, over HTTP too; a pickle that would run code is a 400
    and leaves the weights as they were."""
    import base64
    import os as os_module
    import pickle

    from fastapi.testclient import TestClient

    from spec_engine.server.http_server import create_app
    from spec_engine.weights.transport import deserialize_shared, serialize_shared

    old, new = pair
    tensors = checkpoint_tensors(new)
    shared = serialize_shared([b.to_dict() for b in FlattenedBucket.pack(tensors.items())])
    opened = deserialize_shared(shared)[0]["flattened_tensor"]
    assert opened.is_shared()

    class Evil:
        def __reduce__(self):
            return (os_module.system, ("echo pwned",))

    evil = base64.b64encode(pickle.dumps(Evil())).decode("ascii")
    with pytest.raises(ValueError, match="refusing to unpickle (posix|os).system"):
        deserialize_shared(evil)
    with Engine(model_path=old, random_seed=0) as engine:
        client = TestClient(create_app(engine))
        before = engine.get_weights_checksum()
        bad = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
        assert bad.status_code == 400 and "refusing to unpickle" in bad.json()["error"]["message"]
        assert engine.get_weights_checksum() == before
        two = client.post(
            "/update_weights_from_tensor", json={"serialized_named_tensors": [shared, shared]}
        )
        assert two.status_code == 400 and "one entry per tensor-parallel rank" in two.text
        ok = client.post(
            "/update_weights_from_tensor",
            json={
                "serialized_named_tensors": [shared],
                "load_format": "flattened_bucket",
                "weight_version": "sglang-form",
            },
        )
        assert ok.status_code == 200, ok.text
        assert outputs(engine) == fresh_outputs(new)
        assert engine.get_server_info()["weight_version"] == "sglang-form"


def test_same_process_cuda_handles_use_the_argument_places_torch_rebuilds_from():
    """serialize_shared caches each exported CUDA storage under the (handle, offset) key that
    torch's rebuild_cuda_tensor looks up, read from reduce_tensor's arguments by position (a GPU
    showed the engine failing on its own process's handles without it). The positions are
    torch's: a torch that moves them fails here, on CPU."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from spec_engine.weights import transport

    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert params[transport._REDUCE_TENSOR_ARG_DEVICE_INDEX] == "storage_device"
    assert params[transport._REDUCE_TENSOR_ARG_HANDLE_INDEX] == "storage_handle"
    assert params[transport._REDUCE_TENSOR_ARG_OFFSET_INDEX] == "storage_offset_bytes"
    source = inspect.getsource(rebuild_cuda_tensor)
    assert "(storage_handle, storage_offset_bytes)" in source  # the key it looks up
