"""SGLang's control and introspection endpoints, as its clients call them: weight versions,
weights by name and slime's weights checker, memory release/resume in any subset, loads,
tokenize/detokenize, Prometheus metrics, profiling, --log-requests."""

from __future__ import annotations

import logging
import os

import pytest
from safetensors.torch import load_file

from spec_engine import Engine
from spec_engine.server.http_server import create_app

testclient = pytest.importorskip("fastapi.testclient")

REQUEST = {"input_ids": [5, 6, 7, 8], "sampling_params": {"temperature": 0, "max_new_tokens": 8}}


@pytest.fixture(scope="module")
def path(make_model) -> str:
    return make_model("llama", max_position_embeddings=256)


@pytest.fixture(scope="module")
def served(path):
    with Engine(
        model_path=path,
        random_seed=0,
        max_total_tokens=2048,
        enable_metrics=True,
        log_requests=True,
        cuda_graph_max_bs=4,
    ) as engine:
        yield engine, testclient.TestClient(create_app(engine))


def test_weights_by_name_version_and_checker(served, path):
    engine, client = served
    name = "model.layers.0.self_attn.q_proj.weight"
    values = client.post("/get_weights_by_name", json={"name": name, "truncate_size": 5}).json()
    assert values == pytest.approx(
        load_file(f"{path}/model.safetensors")[name].flatten()[:5].tolist()
    )
    r = client.post("/get_weights_by_name", json={"name": "model.layers.0.q_proj.weight"})
    assert r.status_code == 400 and "did you mean" in r.json()["error"]["message"]
    before = client.post("/generate", json=REQUEST).json()["output_ids"]
    assert client.post("/weights_checker", json={"action": "snapshot"}).json()["success"]
    assert client.post("/weights_checker", json={"action": "reset_tensors"}).json()["success"]
    compare = client.post("/weights_checker", json={"action": "compare"}).json()
    assert not compare["success"] and "differ from the snapshot" in compare["message"]
    # slime then pushes every weight; an update from disk restores them.
    r = client.post("/update_weights_from_disk", json={"model_path": path, "load_format": "auto"})
    assert r.status_code == 200
    assert client.post("/weights_checker", json={"action": "compare"}).json()["success"]
    assert client.post("/generate", json=REQUEST).json()["output_ids"] == before
    client.post("/update_weight_version", json={"new_version": "7"}).raise_for_status()
    assert client.get("/get_weight_version").json() == {"weight_version": "7"}
    assert client.post("/generate", json=REQUEST).json()["meta_info"]["weight_version"] == "7"
    r = client.post("/destroy_weights_update_group", json={"group_name": "nope"})
    assert r.status_code == 400 and "no weight update group 'nope'" in r.json()["error"]["message"]
    r = client.post("/update_weights_from_disk", json={"model_path": path, "load_format": "gguf"})
    assert r.status_code == 400 and r.json()["success"] is False and "gguf" in r.json()["message"]


def test_release_and_resume_in_slimes_order(served):
    """release everything; resume weights (slime's onload_weights), then kv_cache + cuda_graph;
    and a resume without cuda_graph already serves (eagerly)."""
    _, client = served
    before = client.post("/generate", json=REQUEST).json()["output_ids"]
    for first, second in (
        (["weights"], ["kv_cache", "cuda_graph"]),
        (["weights", "kv_cache"], ["cuda_graph"]),
    ):
        client.post("/release_memory_occupation", json={}).raise_for_status()
        client.post("/resume_memory_occupation", json={"tags": first}).raise_for_status()
        if "kv_cache" in first:
            assert client.get("/health_generate").status_code == 200
            assert client.post("/generate", json=REQUEST).json()["output_ids"] == before
        client.post("/resume_memory_occupation", json={"tags": second}).raise_for_status()
        assert client.get("/health_generate").status_code == 200
        assert client.post("/generate", json=REQUEST).json()["output_ids"] == before


def test_loads_tokenize_server_info(served, path):
    engine, client = served
    load = client.get("/v1/loads", params={"include": "core,queues"}).json()
    assert load["loads"][0]["num_total_reqs"] == 0 and load["dp_rank_count"] == 1
    assert load["loads"][0]["max_total_num_tokens"] == 2048
    assert load["loads"][0]["num_total_tokens"] == load["loads"][0]["num_used_tokens"]
    assert client.get("/get_load").json()[0]["num_reqs"] == 0
    assert client.get("/v1/loads", params={"include": "bogus"}).status_code == 400
    tokens = client.post("/tokenize", json={"prompt": "The cat runs"}).json()
    assert tokens["tokens"] == engine.tokenizer("The cat runs")["input_ids"]
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    text = client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["text"]
    assert text == engine.tokenizer.decode(tokens["tokens"])
    assert client.post("/detokenize", json={"tokens": [99999]}).status_code == 400
    info = client.get("/server_info").json()
    assert info["model_path"] == path and info["tp_size"] == 1 and info["dp_size"] == 1
    assert info["enable_memory_saver"] is False and info["disaggregation_mode"] == "null"
    assert "api_key" not in info


def test_metrics_and_request_log(served, caplog):
    engine, client = served
    before = engine.stats.snapshot()["generation_tokens"]
    with caplog.at_level(logging.INFO, logger="spec_engine.requests"):
        client.post("/generate", json=REQUEST).raise_for_status()
    assert any("finished (length): 4 prompt tokens" in r.getMessage() for r in caplog.records)
    text = client.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("sglang:generation_tokens_total"))
    assert float(line.split()[-1]) == before + 8
    assert "sglang:num_requests_total{" in text and "sglang:num_aborted_requests_total{" in text
    assert "sglang:e2e_request_latency_seconds_bucket" in text
    assert "sglang:num_running_reqs" in text


def test_metrics_off_and_profile(path, tmp_path):
    with Engine(model_path=path, random_seed=0, max_total_tokens=1024) as engine:
        client = testclient.TestClient(create_app(engine))
        r = client.get("/metrics")
        assert r.status_code == 404 and "--enable-metrics" in r.json()["error"]["message"]
        started = client.post("/start_profile", json={"output_dir": str(tmp_path)})
        assert started.status_code == 200
        client.post("/generate", json=REQUEST).raise_for_status()
        stopped = client.post("/stop_profile", json={}).json()
        assert os.path.getsize(stopped["path"]) > 0
        assert client.post("/stop_profile", json={}).status_code == 400


def test_abort_request_needs_a_rid_or_abort_all(served):
    _, client = served
    r = client.post("/abort_request", json={})
    assert r.status_code == 400 and "abort_all" in r.json()["error"]["message"]
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
    assert client.post("/abort_request", json={"rid": "none-such"}).status_code == 200
