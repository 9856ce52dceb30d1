"""SGLang's HTTP API as slime and SGLang's own clients call it, in-process (TestClient): abort
with partial outputs and loads back at zero, server info, loads, weight versions, tokenize,
metrics, memory release/resume in any order, weight updates in slime's wire formats (flattened
buckets pickled as slime pickles them, without SGLang installed), the weights checker, and the
OpenAI API through the official client. Oracles: a fresh engine on the new weights, checksums
of the tensors sent, and the engine's own counters."""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import pickle
import shutil
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from spec_engine import Engine, EngineArgs
from spec_engine.server.http_server import create_app
from spec_engine.weights.loader import tensor_checksum
from tests.support.slime_wire import install_fake_sglang, slime_payload
from trainer_bridge.megatron_compat import free_port

testclient = pytest.importorskip("fastapi.testclient")
openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [300, 12, 77, 9, 100]]


@pytest.fixture(scope="module")
def paths(make_model) -> tuple[str, str]:
    """(the served checkpoint, another one of the same shape: the weights pushed to it)."""
    return (
        make_model("llama", max_position_embeddings=256, seed=11),
        make_model("llama", max_position_embeddings=256, seed=12),
    )


@pytest.fixture(scope="module")
def served(paths):
    with Engine(
        model_path=paths[0],
        random_seed=0,
        max_total_tokens=2048,
        enable_metrics=True,
        log_requests=True,
        cuda_graph_max_bs=4,
    ) as engine:
        yield engine, testclient.TestClient(create_app(engine))


def greedy(client, prompts=PROMPTS) -> list[list[int]]:
    r = client.post("/generate", json={"input_ids": prompts, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


def fresh_greedy(path: str) -> list[list[int]]:
    with Engine(model_path=path, random_seed=0) as engine:
        return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def num_requests_from_load(load: Any) -> int:
    """slime's server_control.num_requests_from_load."""
    if isinstance(load, dict) and "loads" in load:
        return sum(num_requests_from_load(x) for x in load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running = load.get("num_running_reqs", load.get("total_running_reqs", 0))
    return running + load.get("num_waiting_reqs", load.get("total_waiting_reqs", 0))


# ------------------------------------------------------------------ abort, loads, server info


def test_abort_by_rid_and_all_returns_partial_outputs(served, caplog):
    """Requests frozen mid-generation (pause in_place), then aborted: by rid, then all. Each
    /generate answers 200 with its tokens so far (a prefix of the uninterrupted greedy output)
    and finish_reason abort; /v1/loads?include=core then reads 0 for slime's helper."""
    engine, client = served
    params = dict(GREEDY, max_new_tokens=200)
    full = engine.generate(input_ids=PROMPTS[0], sampling_params=params)["output_ids"]
    results: dict[str, Any] = {}

    def run(rid: str) -> None:
        body = {"input_ids": PROMPTS[0], "sampling_params": params, "rid": rid}
        results[rid] = client.post("/generate", json={**body, "return_logprob": True})

    threads = [threading.Thread(target=run, args=(f"r{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while client.get("/v1/loads?include=core").json()["loads"][0]["num_running_reqs"] < 3:
        assert time.time() < deadline
    assert client.post("/pause_generation", json={"mode": "in_place"}).json()["status"] == "ok"
    load = client.get("/v1/loads", params={"include": "core,queues"}).json()["loads"][0]
    assert load["num_total_reqs"] == 3 and load["queues"]["paused"] == 3
    with caplog.at_level(logging.INFO, logger="spec_engine.requests"):
        assert client.post("/abort_request", json={"rid": "r1"}).status_code == 200
        threads[1].join(30)
        assert num_requests_from_load(client.get("/v1/loads?include=core").json()) == 2
        assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
        for t in threads:
            t.join(30)
    assert num_requests_from_load(client.get("/v1/loads?include=core").json()) == 0
    client.post("/continue_generation", json={}).raise_for_status()
    for rid, r in results.items():
        assert r.status_code == 200
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        tokens = [t for _, t, _ in meta["output_token_logprobs"]]
        assert 0 < len(tokens) < 200 and tokens == full[: len(tokens)] == r.json()["output_ids"]
        assert any(f"request {rid} finished (abort)" in x.getMessage() for x in caplog.records)


def test_server_info_has_every_arg_and_sglangs_keys(served, paths):
    engine, client = served
    info = client.get("/server_info").json()
    assert info.keys() == client.get("/get_server_info").json().keys()
    missing = {f.name for f in dataclasses.fields(EngineArgs)} - set(info) - {"api_key"}
    assert not missing and "api_key" not in info
    expected = {
        "model_path": paths[0],
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
        "moe_dp_size": 1,
        "nnodes": 1,
        "node_rank": 0,
        "base_gpu_id": 0,
        "gpu_id_step": 1,
        "enable_memory_saver": False,
        "disaggregation_mode": "null",
        "load_balance_method": "round_robin",
        "encoder_only": False,
        "enable_return_routed_experts": False,
        "enable_metrics": True,
        "status": "ready",
        "max_total_num_tokens": 2048,
        "max_req_input_len": 255,
    }
    assert {k: info[k] for k in expected} == expected
    assert isinstance(info["host"], str) and isinstance(info["port"], int) and info["version"]
    assert info["internal_states"][0]["num_running_reqs"] == 0


def test_loads_weight_version_and_legacy_load(served):
    engine, client = served
    full = client.get("/v1/loads").json()
    assert full["dp_rank_count"] == 1 and full["timestamp"].endswith("+00:00")
    load = full["loads"][0]
    assert load["dp_rank"] == 0 and load["max_total_num_tokens"] == 2048
    assert load["num_total_reqs"] == load["num_running_reqs"] + load["num_waiting_reqs"] == 0
    assert load["num_total_tokens"] == load["num_used_tokens"]
    assert load["disaggregation"]["mode"] == "null" and load["queues"]["waiting"] == 0
    assert set(full["aggregate"]) == {
        "total_running_reqs",
        "total_waiting_reqs",
        "total_reqs",
        "avg_token_usage",
        "avg_throughput",
        "avg_utilization",
    }
    core = client.get("/v1/loads?include=core").json()["loads"][0]
    assert "queues" not in core and "disaggregation" not in core
    text = client.get("/v1/loads?format=prometheus").text
    assert 'sglang_num_running_reqs{dp_rank="0"} 0' in text
    assert 'sglang_queues_waiting{dp_rank="0"} 0' in text
    for query, needle in (("include=bogus", "bogus"), ("dp_rank=1", "dp_rank"), ("format=x", "x")):
        r = client.get(f"/v1/loads?{query}")
        assert r.status_code == 400 and needle in r.json()["message"]
    legacy = client.get("/get_load").json()
    assert legacy[0]["num_reqs"] == 0 and legacy[0]["num_waiting_reqs"] == 0
    version = client.post("/update_weight_version", json={"new_version": "v9"}).json()
    assert version == {
        "success": True,
        "message": "Weight version updated to v9",
        "new_version": "v9",
    }
    assert client.get("/get_weight_version").json() == {"weight_version": "v9"}
    out = client.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY})
    assert out.json()["meta_info"]["weight_version"] == "v9"
    assert client.post("/update_weight_version", json={}).status_code == 400


def test_tokenize_detokenize(served):
    engine, client = served
    tok = engine.tokenizer
    r = client.post("/v1/tokenize", json={"prompt": ["The cat", "A dog runs"]}).json()
    assert r["tokens"] == [tok("The cat")["input_ids"], tok("A dog runs")["input_ids"]]
    assert r["count"] == [len(t) for t in r["tokens"]] and r["max_model_len"] == 256
    ids = [1] + r["tokens"][0]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"text": "The cat"}
    kept = client.post("/detokenize", json={"tokens": [ids], "skip_special_tokens": False}).json()
    assert kept == {"text": ["<s>The cat"]}
    assert client.post("/detokenize", json={"tokens": [[1, 99999]]}).status_code == 400


# ------------------------------------------------------------------ metrics


def test_metrics_count_requests_but_not_health_probes(served, paths):
    engine, client = served

    def scrape() -> dict[str, float]:
        values = {}
        for line in client.get("/metrics").text.splitlines():
            if line.startswith("sglang:") and "{" in line:
                values[line.split("{")[0]] = float(line.split()[-1])
        return values

    before = scrape()
    assert client.get("/health_generate").status_code == 200
    assert scrape()["sglang:num_requests_total"] == before["sglang:num_requests_total"]
    outs = client.post("/generate", json={"input_ids": PROMPTS, "sampling_params": GREEDY}).json()
    after = scrape()
    assert after["sglang:num_requests_total"] - before["sglang:num_requests_total"] == 3
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 24
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == sum(
        o["meta_info"]["prompt_tokens"] for o in outs
    )
    assert after["sglang:max_total_num_tokens"] == 2048 and after["sglang:num_running_reqs"] == 0
    for name in ("num_queue_reqs", "token_usage", "cache_hit_rate", "num_aborted_requests_total"):
        assert f"sglang:{name}" in after
    assert after["sglang:e2e_request_latency_seconds_count"] >= 3
    # A registry per server: a second app over another engine registers nothing globally.
    from prometheus_client import REGISTRY

    with Engine(model_path=paths[0], enable_metrics=True, max_total_tokens=512) as other:
        assert testclient.TestClient(create_app(other)).get("/metrics").status_code == 200
    assert not any(m.name.startswith("sglang") for m in REGISTRY.collect())


# ------------------------------------------------------------------ memory, pause, flush

ORDERS = [
    ([None], [["weights"], ["kv_cache", "cuda_graph"]]),  # slime's
    ([["kv_cache", "cuda_graph", "weights"]], [["kv_cache", "weights"], ["cuda_graph"]]),
    ([["weights"], ["kv_cache", "cuda_graph"]], [["cuda_graph"], ["kv_cache"], ["weights"]]),
    ([["cuda_graph"]], [["cuda_graph"]]),
    ([["kv_cache"]], [None]),
]


@pytest.mark.parametrize("releases,resumes", ORDERS, ids=[str(i) for i in range(len(ORDERS))])
def test_release_and_resume_in_any_order(served, releases, resumes):
    """Every order leaves the server healthy with its greedy outputs; while weights or the KV
    cache are out, /health_generate is a 503 at once that says how to bring them back."""
    engine, client = served
    before = greedy(client)
    assert client.get("/flush_cache").status_code == 200
    for tags in releases:
        body = {} if tags is None else {"tags": tags}
        client.post("/release_memory_occupation", json=body).raise_for_status()
    for tags in resumes:
        out = set(engine.memory.released)
        if out - {"cuda_graph"}:
            r = client.get("/health_generate")
            assert r.status_code == 503 and "resume_memory_occupation" in r.text
        else:
            assert greedy(client) == before  # graphs out: served eagerly
        client.post("/resume_memory_occupation", json={"tags": tags}).raise_for_status()
    assert not engine.memory.released
    assert client.get("/health_generate").status_code == 200
    assert greedy(client) == before


def test_pause_continue_and_flush(served):
    _, client = served
    paused = client.post("/pause_generation", json={})
    assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    r = client.get("/health_generate")
    assert r.status_code == 503 and "continue_generation" in r.text
    assert client.get("/flush_cache").status_code == 200
    assert client.post("/continue_generation", json={}).json()["status"] == "ok"
    assert client.get("/health_generate").status_code == 200
    assert client.post("/pause_generation", json={"mode": "later"}).status_code == 400


# ------------------------------------------------------------------ weight updates


def test_update_from_tensor_in_slimes_formats(served, paths, tmp_path, monkeypatch):
    """slime's flattened bucket (two dtypes, byte offsets) loads the new weights: checksums are
    those of the tensors sent and greedy outputs those of a fresh engine on them; the older
    one-dtype layout (element offsets) loads the old ones back; an empty bucket changes nothing.
    The default file-descriptor sharing is a 400 that says what to change."""
    engine, client = served
    meta_cls = install_fake_sglang(monkeypatch)
    old_tensors = load_file(os.path.join(paths[0], "model.safetensors"))
    # The new weights, exact in bfloat16, so half of them can travel as bfloat16.
    new = {n: t.bfloat16().float() for n, t in load_file(f"{paths[1]}/model.safetensors").items()}
    new_dir = tmp_path / "new"
    shutil.copytree(paths[1], new_dir)
    save_file(new, str(new_dir / "model.safetensors"))
    sent = {n: t.bfloat16() if i % 2 else t for i, (n, t) in enumerate(new.items())}
    before = greedy(client)
    body = {"load_format": "flattened_bucket", "flush_cache": False}
    previous = torch.multiprocessing.get_sharing_strategy()
    try:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
        fd = client.post(
            "/update_weights_from_tensor",
            json={**body, "serialized_named_tensors": [slime_payload(sent, meta_cls)[0]]},
        )
        assert fd.status_code == 400 and "set_sharing_strategy('file_system')" in fd.text
        # Shared-memory names: what works between unrelated processes (slime's Ray actors).
        torch.multiprocessing.set_sharing_strategy("file_system")
        payload, payload_tensor = slime_payload(sent, meta_cls)
        # slime's sequence: pause, flush the prefix cache, update (flush_cache false), continue.
        client.post("/pause_generation", json={}).raise_for_status()
        assert client.get("/flush_cache").status_code == 200
        r = client.post(
            "/update_weights_from_tensor",
            json={**body, "serialized_named_tensors": [payload], "weight_version": "1"},
        )
        assert r.status_code == 200 and r.json()["success"], r.text
        client.post("/continue_generation", json={}).raise_for_status()
        assert engine.get_weights_checksum() == {n: tensor_checksum(t) for n, t in new.items()}
        assert greedy(client) == fresh_greedy(str(new_dir)) != before
        empty, _ = slime_payload({}, meta_cls)
        r = client.post(
            "/update_weights_from_tensor",
            json={**body, "serialized_named_tensors": [empty], "weight_version": "2"},
        )
        assert r.json()["weight_version"] == "2"
        assert engine.get_weights_checksum() == {n: tensor_checksum(t) for n, t in new.items()}
        old_layout, old_layout_tensor = slime_payload(old_tensors, meta_cls, byte_offsets=False)
        r = client.post(
            "/update_weights_from_tensor",
            json={**body, "serialized_named_tensors": [old_layout], "flush_cache": True},
        )
        assert r.status_code == 200, r.text
        assert greedy(client) == before
        for extra, needle in (
            ({"serialized_named_tensors": [payload, payload]}, "one entry per tensor-parallel"),
            ({"serialized_named_tensors": [payload], "load_format": "direct"}, "direct"),
            ({"serialized_named_tensors": [payload], "load_format": None}, "load_format"),
            ({"serialized_named_tensors": [payload], "disable_draft_model": True}, "draft"),
        ):
            r = client.post("/update_weights_from_tensor", json={**body, **extra})
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    # os.system, not print: Ray's tqdm support replaces builtins.print once imported.
    evil = base64.b64encode(pickle.dumps({"x": os.system})).decode()
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
    assert r.status_code == 400 and "refusing to unpickle posix.system" in r.text
    assert engine.get_weights_checksum() == {n: tensor_checksum(t) for n, t in old_tensors.items()}


def test_weights_checker_as_slime_checks_an_update(served, paths):
    """snapshot -> reset_tensors -> update -> compare: a partial update fails the compare (400,
    naming a tensor left as reset); a full one passes. skip_tensor_list keeps tensors out of
    both; "checksum" reports SGLang's shape."""
    engine, client = served
    tensors = load_file(os.path.join(paths[0], "model.safetensors"))
    before = greedy(client)

    def check(action: str, **extra: Any):
        return client.post("/weights_checker", json={"action": action, **extra})

    assert check("snapshot").json()["success"]
    assert check("reset_tensors", skip_tensor_list=["lm_head"]).json()["success"]
    partial = {n: t for n, t in tensors.items() if n != "model.norm.weight"}
    engine.update_weights_from_tensor(list(partial.items()))
    r = check("compare")
    assert r.status_code == 400 and r.json()["success"] is False
    assert "model.norm.weight" in r.json()["message"] and "lm_head" not in r.json()["message"]
    rest = [(n, t) for n, t in tensors.items() if n != "lm_head.weight"]
    engine.update_weights_from_tensor(rest)
    assert check("compare").status_code == 200
    assert greedy(client) == before
    report = check("checksum").json()
    assert report["ranks"][0]["checksums"] == engine.get_weights_checksum()
    assert len(report["per_engine_checksum"]) == 64
    assert (
        client.get("/weights_checker").json()["per_engine_checksum"]
        == report["per_engine_checksum"]
    )
    assert check("bogus").status_code == 400
    assert client.post(
        "/post_process_weights",
        json={"restore_weights_before_load": True, "post_process_quantization": False},
    ).json()["success"]


def test_update_from_disk_and_distributed(served, paths):
    """update_weights_from_disk with SGLang's fields (keep_pause leaves generation paused);
    a broadcast group joined over HTTP (gloo; nccl without CUDA is a 400 naming gloo) takes
    dtypes as strings."""
    engine, client = served
    before = greedy(client)
    r = client.post(
        "/update_weights_from_disk",
        json={"model_path": paths[1], "load_format": "safetensors", "weight_version": "d1"},
    )
    assert r.status_code == 200 and r.json()["num_paused_requests"] == 0
    assert greedy(client) == fresh_greedy(paths[1])
    r = client.post(
        "/update_weights_from_disk",
        json={"model_path": paths[0], "load_format": "auto", "keep_pause": True},
    )
    assert r.status_code == 200 and client.get("/health_generate").status_code == 503
    client.post("/continue_generation", json={}).raise_for_status()
    assert greedy(client) == before
    r = client.post("/update_weights_from_disk", json={"model_path": paths[0], "is_async": True})
    assert r.status_code == 400 and "is_async" in r.text
    group = {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2}
    r = client.post(
        "/init_weights_update_group", json={**group, "master_port": 1, "backend": "nccl"}
    )
    assert r.status_code == 400 and "gloo" in r.json()["error"]["message"]
    tensors = load_file(os.path.join(paths[1], "model.safetensors"))
    sent = {n: t.bfloat16() if "mlp" in n else t for n, t in tensors.items()}
    port, ready = free_port(), threading.Event()

    def trainer() -> None:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60))
        group = dist.ProcessGroupGloo(dist.PrefixStore("g", store), 0, 2, timedelta(seconds=60))
        ready.wait(60)
        for tensor in sent.values():
            group.broadcast(tensor, 0).wait()

    thread = threading.Thread(target=trainer)
    thread.start()
    joined = client.post(
        "/init_weights_update_group",
        json={**group, "master_port": port, "group_name": "g", "backend": "gloo"},
    )
    assert joined.status_code == 200, joined.text
    ready.set()
    r = client.post(
        "/update_weights_from_distributed",
        json={
            "names": list(sent),
            "dtypes": [str(t.dtype).replace("torch.", "") for t in sent.values()],
            "shapes": [list(t.shape) for t in sent.values()],
            "group_name": "g",
            "flush_cache": False,
            "weight_version": "7",
            "load_format": None,
        },
    )
    thread.join(60)
    assert r.status_code == 200 and r.json()["weight_version"] == "7", r.text
    assert engine.get_weights_checksum() == {n: tensor_checksum(t.float()) for n, t in sent.items()}
    assert client.post("/destroy_weights_update_group", json={"group_name": "g"}).json()["success"]
    client.post("/update_weights_from_disk", json={"model_path": paths[0]}).raise_for_status()
    assert greedy(client) == before


# ------------------------------------------------------------------ OpenAI API


@pytest.fixture(scope="module")
def oai(served):
    engine, client = served
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)


def test_models_retrieve(served, oai, paths):
    _, client = served
    assert oai.models.retrieve(paths[0]).id == paths[0]
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
    error = client.get("/v1/models/no-such-model").json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_completions_echo_stream_logprobs_usage(served, oai):
    """echo with stream (and log-probs): the streamed text and log-probs are those of the
    non-streamed completion, the prompt's first; usage comes last with include_usage."""
    prompt = "The cat runs"
    args = dict(model="m", prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=1)
    whole = oai.completions.create(**args).choices[0]
    assert whole.text.startswith(prompt)
    chunks = list(
        oai.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    logprobs = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert text == whole.text and logprobs[0] is None is whole.logprobs.token_logprobs[0]
    assert logprobs[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)


def test_completions_n_seed_stop(served, oai):
    engine, _ = served
    args = dict(model="m", prompt="A dog", max_tokens=12, temperature=1.0, n=2, seed=5)
    first = [c.text for c in oai.completions.create(**args).choices]
    assert [c.text for c in oai.completions.create(**args).choices] == first
    assert len(first) == 2
    other = [c.text for c in oai.completions.create(**{**args, "seed": 6}).choices]
    assert other != first
    text = oai.completions.create(model="m", prompt="A dog", max_tokens=12, temperature=0)
    text = text.choices[0].text
    stop = text[4:7]
    stopped = oai.completions.create(
        model="m", prompt="A dog", max_tokens=12, temperature=0, stop=[stop]
    ).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]


def test_chat_logit_bias_forces_a_token(served, oai):
    engine, _ = served
    forced = 100
    chat = oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        logit_bias={str(forced): 100},
    )
    token = engine.tokenizer.decode([forced])
    assert [c.token for c in chat.choices[0].logprobs.content] == [token] * 4
    assert chat.usage.completion_tokens == 4
