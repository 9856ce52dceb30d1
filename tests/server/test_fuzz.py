"""Property-based fuzz of the request bodies (hypothesis): whatever JSON a client sends to
/generate, the OpenAI endpoints, /v1/score and /v1/responses, the answer is a well-formed 2xx or
4xx (never a 500, never a hang), its JSON holds no NaN or Infinity, and the server keeps
serving."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_engine import Engine
from spec_engine.server.http_server import create_app

testclient = pytest.importorskip("fastapi.testclient")

# Values a client might put anywhere: the right types, wrong types, edge numbers.
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from([0, 1, -1, 2, 512, 1e-40, 0.5, 1.0, 2.0, 1e9]),
    st.text(max_size=12),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
SAMPLING_KEYS = [
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_new_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "custom_params",
    "sampling_seed",
    "skip_special_tokens",
    "no_stop_trim",
    "regex",
]
SMALL_IDS = st.lists(st.integers(min_value=-2, max_value=520), min_size=0, max_size=6)
SAMPLING = st.dictionaries(
    st.sampled_from(SAMPLING_KEYS),
    st.one_of(VALUES, st.integers(min_value=0, max_value=8), st.floats(0, 2)),
    max_size=6,
)
GENERATE = st.fixed_dictionaries(
    {},
    optional={
        "text": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=8), max_size=3)),
        "input_ids": st.one_of(SMALL_IDS, st.lists(SMALL_IDS, max_size=3), VALUES),
        "sampling_params": st.one_of(SAMPLING, st.lists(SAMPLING, max_size=3), VALUES),
        "return_logprob": st.one_of(st.booleans(), VALUES),
        "top_logprobs_num": st.one_of(st.integers(-1, 5), VALUES),
        "logprob_start_len": st.one_of(st.integers(-2, 5), VALUES),
        "stream": st.booleans(),
        "rid": st.one_of(st.text(max_size=6), VALUES),
        "return_routed_experts": VALUES,
        "bogus": VALUES,
    },
)
COMPLETION = st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=6),
        "prompt": st.one_of(st.text(max_size=20), SMALL_IDS, VALUES),
        "max_tokens": st.one_of(st.integers(-1, 6), VALUES),
        "temperature": st.one_of(st.floats(0, 2), VALUES),
        "n": st.one_of(st.integers(0, 3), VALUES),
        "logprobs": st.one_of(st.integers(-1, 3), VALUES),
        "echo": VALUES,
        "stop": VALUES,
        "seed": VALUES,
        "logit_bias": VALUES,
        "stream": st.booleans(),
    },
)


SCORE = st.fixed_dictionaries(
    # The fields SGLang needs, in every body (their absence is tested in test_responses_score.py).
    {
        "query": st.one_of(st.text(max_size=12), SMALL_IDS, VALUES),
        "items": st.one_of(
            st.lists(st.text(max_size=6), max_size=3),
            st.lists(SMALL_IDS, max_size=3),
            st.text(max_size=8),
            VALUES,
        ),
        "label_token_ids": st.one_of(SMALL_IDS, VALUES),
    },
    optional={"apply_softmax": VALUES, "item_first": VALUES, "model": VALUES},
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant", "system", "developer"]), VALUES)},
    optional={
        "content": st.one_of(
            st.text(max_size=10),
            st.lists(
                st.fixed_dictionaries({"type": st.text(max_size=11), "text": VALUES}), max_size=2
            ),
            VALUES,
        ),
        "type": st.one_of(st.just("message"), VALUES),
    },
)
RESPONSES = st.fixed_dictionaries(
    {},
    optional={
        "input": st.one_of(st.text(max_size=20), st.lists(MESSAGE, max_size=3), VALUES),
        "instructions": st.one_of(st.text(max_size=10), VALUES),
        "max_output_tokens": st.one_of(st.integers(-1, 6), VALUES),
        "temperature": st.one_of(st.floats(0, 2), VALUES),
        "top_p": st.one_of(st.floats(0, 1), VALUES),
        "store": VALUES,
        "previous_response_id": st.one_of(st.text(max_size=8), VALUES),
        "tools": VALUES,
        "text": VALUES,
        "tool_choice": VALUES,
        "stop": VALUES,
        "metadata": VALUES,
    },
)


@pytest.fixture(scope="module")
def client(make_model):
    path = make_model("llama", max_position_embeddings=128)
    with Engine(model_path=path, random_seed=0, max_total_tokens=2048) as engine:
        yield testclient.TestClient(create_app(engine))


def check(client, path: str, body: dict) -> None:
    r = client.post(path, content=json.dumps(body))
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    assert r.status_code in (200, 400, 404, 413), (body, r.status_code)
    if "event-stream" in r.headers.get("content-type", ""):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            _finite(json.loads(event))
    else:
        _finite(r.json())


def _finite(value) -> None:
    """JSON from the server parses without NaN/Infinity (json.loads would accept them)."""
    if isinstance(value, float):
        assert math.isfinite(value)
    elif isinstance(value, dict):
        for v in value.values():
            _finite(v)
    elif isinstance(value, list):
        for v in value:
            _finite(v)


FUZZ = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# The scoring and responses endpoints share the request path fuzzed above: fewer examples.
FUZZ_FEW = settings(FUZZ, max_examples=30)


@FUZZ
@given(body=GENERATE)
def test_generate_answers_every_body_with_2xx_or_4xx(client, body):
    if isinstance(body.get("sampling_params"), dict):
        body["sampling_params"].setdefault("max_new_tokens", 4)
    check(client, "/generate", body)


@FUZZ
@given(body=COMPLETION)
def test_completions_answer_every_body_with_2xx_or_4xx(client, body):
    check(client, "/v1/completions", body)


@FUZZ_FEW
@given(body=SCORE)
def test_score_answers_every_body_with_2xx_or_4xx(client, body):
    check(client, "/v1/score", body)


@FUZZ_FEW
@given(body=RESPONSES)
def test_responses_answer_every_body_with_2xx_or_4xx(client, body):
    if body.get("max_output_tokens") is None:
        body["max_output_tokens"] = 4
    check(client, "/v1/responses", body)


def test_still_serving_after_the_fuzz(client):
    assert client.get("/health_generate").status_code == 200
    load = client.get("/v1/loads").json()["loads"][0]
    assert load["num_total_reqs"] == 0 and load["num_used_tokens"] == 0
