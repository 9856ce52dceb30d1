"""SGLang's small server behaviours, as its own server tests check them (issue #47 item 1):
duplicate rids, "Abort in waiting queue", chat stream deltas with every DeltaMessage key,
--incremental-streaming-output, --schedule-policy random, /get_model_info after
/update_weights_from_disk and a failed update's body, --tokenizer-worker-num. One engine with
one running request at a time (so that others queue), in-process (TestClient). Oracles: the
engine's own non-streamed outputs and SGLang's messages and field names as written in its source
(tokenizer_manager.py, protocol.py, http_server.py)."""

from __future__ import annotations

import json
import threading

import pytest

from spec_engine import Engine
from spec_engine.args.sglang_compat import check_sglang_options
from spec_engine.core.request import Req, ReqInput
from spec_engine.core.timeouts import RequestTimeouts
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


def test_a_request_queued_past_sglang_queued_timeout_ms_is_a_503(paths):
    """SGLang's test_abort.py TestAbortWithQueueTimeout: 1 ms of queueing allowed, one request
    running at a time, two sent together: exactly one is refused with SGLang's 503 body."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SGLANG_QUEUED_TIMEOUT_MS", "1")
        engine = Engine(model_path=paths[0], random_seed=0, max_total_tokens=2048, **ENGINE)
    with engine:
        client = testclient.TestClient(create_app(engine))
        body = {"input_ids": [5, 6, 7], "sampling_params": LONG}
        results = []
        threads = [
            threading.Thread(target=lambda: results.append(client.post("/generate", json=body)))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert sorted(r.status_code for r in results) == [200, 503]
        refused = next(r.json() for r in results if r.status_code == 503)
        assert refused["object"] == "error" and refused["code"] == 503
        assert refused["message"] == "Request waiting timeout reached."


def test_request_timeouts_read_sglangs_variables():
    def req(waited: float, ran: float) -> Req:
        r = Req(input=ReqInput(rid="r", origin_input_ids=(1,), sampling_params=None, seed=0))
        r.wait_queue_entry_time, r.forward_entry_time = waited, ran
        return r

    assert RequestTimeouts.from_env({}) == RequestTimeouts(-1.0, -1.0, 503)
    timeouts = RequestTimeouts.from_env(
        {"SGLANG_QUEUED_TIMEOUT_MS": "1500", "SGLANG_REQ_RUNNING_TIMEOUT": "2"}
    )
    assert timeouts == RequestTimeouts(1.5, 2.0, 503)
    # The new name wins over the old one; the status code is SGLang's variable.
    assert RequestTimeouts.from_env(
        {
            "SGLANG_REQ_WAITING_TIMEOUT": "3",
            "SGLANG_QUEUED_TIMEOUT_MS": "1",
            "SGLANG_TIMED_OUT_REQUEST_STATUS_CODE": "504",
        }
    ) == RequestTimeouts(3.0, -1.0, 504)
    queued, fresh, running = req(1.0, 0.0), req(9.0, 0.0), req(1.0, 7.0)
    recent, never_ran = req(1.0, 8.3), req(1.0, 0.0)  # ran 1.7 s (< 2); not yet run
    expired = timeouts.expired([queued, fresh], [running, recent, never_ran], now=10.0)
    assert [(r is queued, r is running, m) for r, m in expired] == [
        (True, False, "Request waiting timeout reached."),
        (False, True, "Request running timeout reached."),
    ]
    with pytest.raises(ValueError, match="SGLANG_REQ_RUNNING_TIMEOUT='soon' is not a number"):
        RequestTimeouts.from_env({"SGLANG_REQ_RUNNING_TIMEOUT": "soon"})


def test_detokenize_of_an_id_outside_the_vocabulary_is_a_400(served):
    """SGLang answers 500 here: the tokenizer's OverflowError misses its 'decode' test for a
    client error (serving_tokenize.py), though its message calls such input invalid. specrl keeps
    the 400, naming the id."""
    _, client = served
    for tokens in ([5, -1], [[5], [-1]]):
        r = client.post("/detokenize", json={"tokens": tokens})
        assert r.status_code == 400 and "(got -1)" in r.json()["error"]["message"], r.text
    assert client.post("/detokenize", json={"tokens": [5]}).status_code == 200


def test_skip_tokenizer_init_streams_incremental_output_ids(paths):
    """SGLang's test_skip_tokenizer_init.py with --incremental-streaming-output: ids in, each
    streamed chunk's output_ids the new ones only, no text."""
    with Engine(model_path=paths[0], skip_tokenizer_init=True, **ENGINE) as engine:
        client = testclient.TestClient(create_app(engine))
        params = {"temperature": 0, "max_new_tokens": 8}
        body = {"input_ids": [40, 41, 42], "sampling_params": params}
        whole = client.post("/generate", json=body).json()
        chunks = _events(client.post("/generate", json={**body, "stream": True}))
    assert len(chunks) > 1 and all(c["text"] is None for c in chunks)
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]


def test_stop_token_ids_past_the_vocabulary_are_ignored_as_sglang_does(served):
    """SGLang's SamplingParams keeps any int in stop_token_ids (its tests stop on Llama-3's id
    119690 with every model): an id the model cannot produce never matches, in-vocabulary ones
    still stop, on /generate and the OpenAI endpoints."""
    engine, client = served
    vocab = engine.model_config.vocab_size
    greedy = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    plain = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": greedy})
    ids = plain.json()["output_ids"]
    far = {**greedy, "stop_token_ids": [vocab, 119690]}
    r = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": far})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == ids
    mixed = {"temperature": 0, "max_new_tokens": 5, "stop_token_ids": [119690, ids[1]]}
    r = client.post("/generate", json={"input_ids": [[5, 6, 7]], "sampling_params": [mixed]})
    assert r.status_code == 200, r.text
    assert r.json()[0]["output_ids"] == ids[: ids.index(ids[1]) + 1]
    assert r.json()[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[1]}
    for path, body in (
        ("/v1/completions", {"model": "m", "prompt": [5, 6, 7], "max_tokens": 5}),
        ("/v1/chat/completions", CHAT),
    ):
        body = {**body, "temperature": 0, "stop_token_ids": [119690]}
        r = client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
    # Still a 400: a negative id is a client's mistake, not another model's vocabulary.
    r = client.post(
        "/generate", json={"input_ids": [5], "sampling_params": {"stop_token_ids": [-1]}}
    )
    assert r.status_code == 400 and "stop_token_ids" in r.json()["error"]["message"]


def test_streamed_chat_sends_no_empty_delta_chunks(served, paths):
    """SGLang's serving_chat sends a chunk only with content (its test_openai_server.py asserts
    every delta after the first has text, or a finish_reason): a step whose text is held back
    (here a lone UTF-8 lead byte, forced by logit_bias) sends nothing, and its log-probs go with
    the next chunk, none lost."""
    from transformers import AutoTokenizer

    _, client = served
    lead = AutoTokenizer.from_pretrained(paths[0]).convert_tokens_to_ids("â")  # byte 0xE2
    body = {
        **CHAT,
        "max_tokens": 4,
        "stream": True,
        "logprobs": True,
        "logit_bias": {str(lead): 100},
    }
    chunks = _events(client.post("/v1/chat/completions", json=body))
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["delta"]["role"] == "assistant"
    for c in choices[1:]:
        assert isinstance(c["delta"]["content"], str) or c["finish_reason"], chunks
    tokens = [t for c in choices[1:] if c["logprobs"] for t in c["logprobs"]["content"]]
    assert len(tokens) == 4 and choices[-1]["finish_reason"] == "length"
