"""Constrained decoding over HTTP as SGLang serves it, through the official OpenAI client:
`regex` / `ebnf` / `json_schema` extra fields, OpenAI's response_format (json_object and
json_schema), /generate's sampling params, and SGLang's 400s for bad grammars and for
--grammar-backend none. Every finished output parses (re.fullmatch, json.loads, jsonschema)."""

from __future__ import annotations

import json
import re

import pytest

from spec_engine import Engine
from spec_engine.server.http_server import create_app

testclient = pytest.importorskip("fastapi.testclient")
openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(make_model):
    path = make_model("llama", max_position_embeddings=256, seed=11)
    with Engine(
        model_path=path,
        random_seed=0,
        max_total_tokens=2048,
        constrained_json_disable_any_whitespace=True,
    ) as engine:
        client = testclient.TestClient(create_app(engine))
        yield (
            client,
            openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client),
        )


def test_openai_client_constrained_outputs_parse(served):
    _, oai = served
    for extra, pattern in (
        ({"regex": r"(red|green|blue)-[0-9]{2}"}, r"(red|green|blue)-[0-9]{2}"),
        ({"ebnf": 'root ::= "x" [0-9] ("," "x" [0-9])?'}, r"x[0-9](,x[0-9])?"),
    ):
        out = oai.completions.create(
            model="m", prompt="pick:", max_tokens=24, temperature=0, extra_body=extra
        )
        assert out.choices[0].finish_reason == "stop"
        assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text
        chat = oai.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "pick"}],
            max_tokens=24,
            temperature=1.0,
            n=2,
            seed=3,
            extra_body=extra,
        )
        for choice in chat.choices:
            assert choice.finish_reason == "stop"
            assert re.fullmatch(pattern, choice.message.content), choice.message.content
    formats = [
        {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}},
        {"type": "json_object"},
    ]
    for fmt in formats:
        chat = oai.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "json please"}],
            max_tokens=64,
            temperature=0,
            response_format=fmt,
        )
        choice = chat.choices[0]
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content)
        assert isinstance(value, dict)
        if fmt["type"] == "json_schema":
            jsonschema = pytest.importorskip("jsonschema")
            jsonschema.validate(value, SCHEMA)


def test_bad_grammars_are_sglangs_400s(served, make_model):
    client, oai = served
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"regex": "([a"}})
    assert r.status_code == 400
    assert r.json() == {
        "error": {"message": "Invalid grammar request: req.grammar_key=('regex', '([a')"}
    }
    with pytest.raises(openai.BadRequestError, match="Only one of regex, json_schema, or ebnf"):
        oai.completions.create(
            model="m",
            prompt="x",
            max_tokens=4,
            extra_body={"regex": "a", "response_format": {"type": "json_object"}},
        )
    with pytest.raises(openai.BadRequestError, match="response_format type 'grammar'"):
        oai.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "grammar"},
        )
    body = {"text": "hi", "return_logprob": True, "top_logprobs_num": 5}
    r = client.post("/generate", json={**body, "sampling_params": {"regex": "(yes|no)"}})
    assert r.status_code == 200 and r.json()["text"] in ("yes", "no")
    # Forbidden tokens among the top 5 have log-prob -inf: null, as SGLang's orjson writes it.
    last = r.json()["meta_info"]["output_top_logprobs"][-1]
    assert [lp for lp, _, _ in last][1:] == [None] * 4  # only EOS may end "yes" / "no"
    path = make_model("llama", max_position_embeddings=256, seed=11)
    with Engine(model_path=path, grammar_backend="none", max_total_tokens=1024) as engine:
        r = testclient.TestClient(create_app(engine)).post(
            "/generate", json={"text": "hi", "sampling_params": {"regex": "a+"}}
        )
    assert r.status_code == 400
    assert "when the server is launched with --grammar-backend none" in r.json()["error"]["message"]
