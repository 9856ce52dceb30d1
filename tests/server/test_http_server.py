"""A real server on 127.0.0.1: the OpenAI client, plain HTTP to /generate, and bad input."""

from __future__ import annotations

import json
import threading
import time

import pytest

# The dev extra's clients: without them (a GPU box with the runtime only) this module skips,
# and `pytest -m gpu` still collects.
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.support.server_process import served  # noqa: E402 (needs httpx)
from trainer_bridge.megatron_compat import free_port  # noqa: E402

CONTEXT = 256


@pytest.fixture(scope="module")
def server(make_model):
    path = make_model("llama", max_position_embeddings=CONTEXT)
    flags = ["--model-path", path, "--random-seed", "0", "--max-total-tokens", "2048"]
    with served(flags + ["--log-level", "warning"], free_port()) as url:
        yield url, path


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused")


def test_generate_plain_http_matches_transformers(server, hf):
    url, path = server
    prompt = [5, 60, 7, 300, 42]
    r = httpx.post(
        url + "/generate",
        json={
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 12},
        },
    )
    assert r.status_code == 200
    out = r.json()
    ref, ref_lp = hf.greedy(path, prompt, 12)
    assert out["output_ids"] == ref
    assert (
        max(abs(e[0] - b) for e, b in zip(out["meta_info"]["output_token_logprobs"], ref_lp)) < 1e-4
    )
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_batch_and_stream(server):
    url, _ = server
    params = {"temperature": 0, "max_new_tokens": 10}
    batch = httpx.post(
        url + "/generate", json={"text": ["The cat", "A dog runs"], "sampling_params": params}
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    chunks = []
    with httpx.stream(
        "POST",
        url + "/generate",
        json={"text": "The cat", "sampling_params": params, "stream": True},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: ") :])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert len(events) >= 2
    assert events[-1]["output_ids"] == batch[0]["output_ids"]
    assert events[-1]["text"] == batch[0]["text"]
    assert [len(e["output_ids"]) for e in events] == sorted(len(e["output_ids"]) for e in events)


def test_openai_completions(client, server):
    url, _ = server
    r = client.completions.create(
        model="any", prompt="The cat runs", max_tokens=8, temperature=0, logprobs=3
    )
    native = httpx.post(
        url + "/generate",
        json={"text": "The cat runs", "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
    ).json()
    assert r.choices[0].text == native["text"]
    assert r.usage.completion_tokens == 8
    assert len(r.choices[0].logprobs.token_logprobs) == 8
    assert all(len(top) <= 3 for top in r.choices[0].logprobs.top_logprobs)
    assert r.choices[0].finish_reason == "length"
    many = client.completions.create(
        model="any", prompt="The cat", max_tokens=4, temperature=1.0, n=3, seed=1
    )
    assert len(many.choices) == 3


def test_openai_chat_completions_stream_equals_non_stream(client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is two plus two?"},
    ]
    full = client.chat.completions.create(
        model="any", messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    assert full.choices[0].message.role == "assistant"
    assert len(full.choices[0].logprobs.content) == full.usage.completion_tokens
    pieces = []
    usage = None
    for chunk in client.chat.completions.create(
        model="any",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert [m.id for m in client.models.list().data] != []


BAD_BODIES = [
    ('{"text": "hi", "sampling_params": {"max_new_tokens": 4,', "malformed JSON"),
    ({"text": "hi", "sampling_params": {"temprature": 0.5}}, "temprature"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "hi", "return_routed_experts": True}, "no MoE layers"),
    ({"text": "hi", "custom_logit_processor": "x"}, "--enable-custom-logit-processor"),
    ({"text": "hi", "sampling_params": {"json_schema": "{bad"}}, "Invalid grammar request"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": CONTEXT + 10}}, "context length"),
    ({"input_ids": [5] * (CONTEXT + 1)}, "context length"),
    ({"text": ""}, "empty"),
    ({"input_ids": [5, 100000]}, "vocabulary"),
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"text": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"text": "hi", "bogus": 1}, "bogus"),
]


@pytest.mark.parametrize("body,needle", BAD_BODIES, ids=[n for _, n in BAD_BODIES])
def test_bad_input_gets_400_and_server_keeps_serving(server, body, needle):
    url, _ = server
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + "/generate", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200


def test_openai_bad_input_is_a_bad_request_error(client, server):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="any", prompt="hi", max_tokens=4, top_p=1.5)
    with pytest.raises(openai.BadRequestError, match="prompt is an empty list"):
        client.completions.create(model="any", prompt=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=0
        )
    r = httpx.post(
        server[0] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "nonsense": True}
    )
    assert r.status_code == 400 and "nonsense" in r.json()["message"]
    assert httpx.get(server[0] + "/health_generate", timeout=60).status_code == 200


def test_bad_requests_do_not_disturb_running_ones(server):
    url, _ = server
    result = {}

    def long_request() -> None:
        result["r"] = httpx.post(
            url + "/generate",
            json={
                "input_ids": [5, 6, 7],
                "sampling_params": {"max_new_tokens": 120, "ignore_eos": True, "temperature": 0},
            },
            timeout=120,
        )

    t = threading.Thread(target=long_request)
    t.start()
    for body, _ in BAD_BODIES[1:5]:
        assert httpx.post(url + "/generate", json=body).status_code == 400
    t.join()
    assert result["r"].status_code == 200
    assert len(result["r"].json()["output_ids"]) == 120


def test_info_flush_and_abort_endpoints(server):
    url, path = server
    info = httpx.get(url + "/get_model_info").json()
    assert info["model_path"] == path and info["is_generation"] is True
    server_info = httpx.get(url + "/get_server_info").json()
    assert server_info["max_total_num_tokens"] == 2048 and server_info["random_seed"] == 0
    assert server_info["internal_states"][0]["num_running_reqs"] == 0
    assert httpx.post(url + "/flush_cache").status_code == 200
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault(
            "r",
            httpx.post(
                url + "/generate",
                json={
                    "input_ids": [5, 6],
                    "rid": "to-abort",
                    "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                },
                timeout=60,
            ),
        )
    )
    t.start()
    deadline = time.time() + 30
    while httpx.get(url + "/get_server_info").json()["internal_states"][0]["num_running_reqs"] == 0:
        assert time.time() < deadline
    assert httpx.post(url + "/abort_request", json={"rid": "to-abort"}).status_code == 200
    t.join()
    out = result["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 200
    assert httpx.post(url + "/abort_request", json={}).status_code == 400


def test_openai_refusals_are_clear(server):
    url = server[0]
    r = httpx.post(
        url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "chat_template_kwargs": {"tokenize": True},
        },
    )
    assert r.status_code == 400 and "chat template" in r.json()["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "best_of": 3})
    assert r.status_code == 400 and "best_of" in r.json()["message"]


def test_openai_streams_logprobs(server):
    """Streamed chunks carry the log-probs of their new tokens: together those of the whole
    completion, equal to the non-streamed ones."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = httpx.post(server[0] + "/v1/chat/completions", json=body).json()
    expected = [e["logprob"] for e in whole["choices"][0]["logprobs"]["content"]]
    streamed = []
    with httpx.stream(
        "POST", server[0] + "/v1/chat/completions", json={**body, "stream": True}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"]
                if choice and choice[0]["logprobs"]:
                    streamed += [e["logprob"] for e in choice[0]["logprobs"]["content"]]
    assert len(expected) == 6 and streamed == pytest.approx(expected, abs=1e-5)


def test_api_key_guards_everything_but_health(make_model):
    from fastapi.testclient import TestClient

    from spec_engine import Engine
    from spec_engine.server.http_server import create_app

    with Engine(model_path=make_model("llama"), random_seed=0, api_key="sekret") as engine:
        client = TestClient(create_app(engine))
        assert client.get("/health").status_code == 200
        assert client.get("/health_generate").status_code == 200
        assert client.post("/generate", json={"input_ids": [5, 6]}).status_code == 401
        ok = client.post(
            "/generate",
            json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
            headers={"Authorization": "Bearer sekret"},
        )
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2
        info = client.get("/get_server_info", headers={"Authorization": "Bearer sekret"}).json()
        assert "api_key" not in info
