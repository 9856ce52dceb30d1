"""SGLang's small server behaviours, as its own server tests check them (issue #47 item 1):
duplicate rids, "Abort in waiting queue", chat stream deltas with every DeltaMessage key,
--incremental-streaming-output, --schedule-policy random, /get_model_info after
/update_weights_from_disk and a failed update's body, --tokenizer-worker-num. One engine with
one running request at a time (so that others queue), in-process (TestClient). Oracles: the
engine's own non-streamed outputs and SGLang's messages and field names as written in its source
(tokenizer_manager.py, protocol.py, http_server.py)."""

from __future__ import annotations

import json

import pytest

from spec_engine import Engine
from spec_engine.args.sglang_compat import check_sglang_options
from spec_engine.launch_server import build_parser
from spec_engine.server.http_server import create_app

testclient = pytest.importorskip("fastapi.testclient")

LONG = {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True}


# One request runs at a time, so that others queue.
ENGINE = dict(max_running_requests=1, schedule_policy="random", incremental_streaming_output=True)
CHAT = {
    "model": "any",
    "messages": [{"role": "user", "content": "Hi."}],
    "max_tokens": 6,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def paths(make_model) -> tuple[str, ...]:
    """(the served checkpoint, another of the same shape to update to)."""
    return tuple(make_model("llama", max_position_embeddings=256, seed=s) for s in (21, 22))


@pytest.fixture(scope="module")
def served(paths):
    with Engine(model_path=paths[0], random_seed=0, max_total_tokens=2048, **ENGINE) as engine:
        yield engine, testclient.TestClient(create_app(engine))


def _events(response) -> list[dict]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_a_duplicate_rid_gets_sglangs_message(served):
    engine, client = served
    stream = engine.generate(input_ids=[5, 6, 7], sampling_params=LONG, rid="dup", stream=True)
    next(stream)
    r = client.post("/generate", json={"input_ids": [5, 6], "rid": "dup"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("Duplicate request ID detected: dup ")
    engine.abort_request("dup")
    list(stream)


def test_abort_all_words_queued_requests_as_sglang(served):
    engine, client = served
    prompts = [[10 + i, 11, 12] for i in range(3)]
    stream = engine.generate(input_ids=prompts, sampling_params=LONG, stream=True)
    next(stream)  # the first admitted one runs; with one running request the others queue
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
    finished = {}
    for out in stream:
        if out["meta_info"]["finish_reason"] is not None:
            finished[out["index"]] = out["meta_info"]["finish_reason"]
    messages = sorted(f["message"] for f in finished.values())
    assert all(f["type"] == "abort" for f in finished.values()) and len(finished) == 3
    assert messages == ["Abort in waiting queue"] * 2 + ["aborted by request"]
    # An explicit abort_message is kept, queued or not.
    stream = engine.generate(input_ids=prompts[:2], sampling_params=LONG, stream=True)
    next(stream)
    client.post("/abort_request", json={"abort_all": True, "abort_message": "bye"})
    reasons = [o["meta_info"]["finish_reason"] for o in stream if o["meta_info"]["finish_reason"]]
    assert [f["message"] for f in reasons] == ["bye", "bye"]


def test_chat_stream_deltas_carry_every_key(served):
    _, client = served
    chunks = _events(client.post("/v1/chat/completions", json={**CHAT, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert all(set(d) == {"role", "content", "reasoning_content", "tool_calls"} for d in deltas)
    assert deltas[0] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": None,
        "tool_calls": None,
    }
    assert all(d["role"] is None and d["reasoning_content"] is None for d in deltas[1:])
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    full = client.post("/v1/chat/completions", json=CHAT).json()
    assert "".join(d["content"] or "" for d in deltas) == full["choices"][0]["message"]["content"]


def test_incremental_streaming_output_sends_disjoint_segments(served):
    engine, client = served
    body = {
        "input_ids": [40, 41, 42],
        "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True},
        "return_logprob": True,
    }
    whole = client.post("/generate", json=body).json()
    chunks = _events(client.post("/generate", json={**body, "stream": True}))
    assert len(chunks) > 1
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in streamed] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["completion_tokens"] == len(whole["output_ids"])


def test_schedule_policy_random_admits_out_of_order(served):
    engine, _ = served
    prompts = [[60 + i, 61, 62] for i in range(6)]
    params = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    # One request runs at a time: finishing order is admission order (e2e latencies all start
    # together at submission).
    order = sorted(range(6), key=lambda i: outs[i]["meta_info"]["e2e_latency"])
    assert order != list(range(6))
    for prompt, out in zip(prompts, outs):  # the order changes nothing in the outputs
        assert (
            out["output_ids"]
            == engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
        )


def test_model_info_names_the_updated_checkpoint_and_a_failed_update_says_success_false(
    served, paths
):
    engine, client = served
    assert client.get("/get_model_info").json()["model_path"] == paths[0]
    r = client.post("/update_weights_from_disk", json={"model_path": paths[1]})
    assert r.status_code == 200 and r.json()["success"] is True
    assert client.get("/get_model_info").json()["model_path"] == paths[1]
    r = client.post("/update_weights_from_disk", json={"model_path": paths[1] + "-wrong"})
    assert r.status_code == 400
    body = r.json()
    assert body["success"] is False and "-wrong" in body["message"]
    assert client.get("/get_model_info").json()["model_path"] == paths[1]
    r = client.post("/update_weights_from_disk", json={"model_path": paths[0]})
    assert r.json()["success"] is True
    assert client.get("/get_model_info").json()["model_path"] == paths[0]


def test_tokenizer_worker_num_one_is_accepted_more_refused():
    args = build_parser().parse_args(["--model-path", "m", "--tokenizer-worker-num", "1"])
    assert args.tokenizer_worker_num == 1
    assert check_sglang_options({"tokenizer_worker_num": 1}) == []
    with pytest.raises(ValueError, match="--tokenizer-worker-num 2 is not supported: .*one"):
        check_sglang_options({"tokenizer_worker_num": 2})
    with pytest.raises(ValueError, match="--stream-output True .*incremental-streaming-output"):
        check_sglang_options({"stream_output": True})
