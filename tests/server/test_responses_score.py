"""SGLang's /v1/score and /v1/responses (issue #47 item 4). Scores against transformers' forward
on the same checkpoint (SGLang's test_score_api.py oracle); responses through the official
openai client against transformers' greedy generation on the chat-templated conversation."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from transformers import AutoTokenizer

from spec_engine import Engine
from spec_engine.server.http_server import create_app

openai = pytest.importorskip("openai")
testclient = pytest.importorskip("fastapi.testclient")

LONG = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def path(make_model) -> str:
    # test_sglang_behaviours.py's checkpoint: built once per session.
    return make_model("llama", max_position_embeddings=256, seed=21)


@pytest.fixture(scope="module")
def served(path):
    """(engine, HTTP client, openai client): one request runs at a time, so others queue."""
    with Engine(model_path=path, random_seed=0, max_total_tokens=2048, max_running_requests=1) as e:
        # As a context manager the client keeps one event loop, as a server does: background
        # responses run on after their request has been answered.
        with testclient.TestClient(create_app(e)) as client:
            oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
            yield e, client, oai


@pytest.fixture(scope="module")
def tok(path):
    return AutoTokenizer.from_pretrained(path)


def _hf_scores(hf, path, prompts: list[list[int]], labels: list[int]) -> tuple[list, list]:
    """(full-vocabulary probabilities of the labels, softmax over the labels' logits) at the
    position after each prompt."""
    probs, softmaxed = [], []
    for ids in prompts:
        logits = hf.next_token_logits(path, ids).double()
        probs.append(torch.softmax(logits, -1)[labels].tolist())
        softmaxed.append(torch.softmax(logits[labels], -1).tolist())
    return probs, softmaxed


def test_score_matches_transformers_for_text_and_token_ids(served, hf, path, tok):
    _, client, _ = served
    labels = [5, 17, 300]
    cases = [
        # (query, items, as the prompts are built: text then tokenized, or ids joined)
        ("The cat", [" sat", " ran far", ""], False),
        (" is a city", ["Tokyo", "Paris"], True),
    ]
    for query, items, item_first in cases:
        texts = [i + query if item_first else query + i for i in items]
        prompts = [tok(t)["input_ids"] for t in texts]
        probs, softmaxed = _hf_scores(hf, path, prompts, labels)
        for apply_softmax, want in ((False, probs), (True, softmaxed)):
            body = {"query": query, "items": items, "label_token_ids": labels}
            body.update(apply_softmax=apply_softmax, item_first=item_first, model="m")
            r = client.post("/v1/score", json=body)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["object"] == "scoring" and got["model"] == "m"
            assert got["usage"]["prompt_tokens"] == sum(map(len, prompts))
            assert torch.allclose(torch.tensor(got["scores"]), torch.tensor(want), atol=1e-4)
    query, items = [5, 60, 7], [[300, 42], [9], [11, 12, 13]]
    for item_first in (False, True):
        prompts = [i + query if item_first else query + i for i in items]
        want = _hf_scores(hf, path, prompts, labels)[1]
        body = {"query": query, "items": items, "label_token_ids": labels}
        r = client.post("/v1/score", json={**body, "apply_softmax": True, "item_first": item_first})
        assert r.status_code == 200, r.text
        assert torch.allclose(torch.tensor(r.json()["scores"]), torch.tensor(want), atol=1e-4)


def test_score_refuses_bad_input_with_sglangs_messages(served, path):
    engine, client, _ = served
    vocab = engine.model_config.vocab_size
    ok = {"query": "a", "items": ["b"], "label_token_ids": [1]}
    cases = [
        ({"query": "a", "items": ["b"]}, "label_token_ids must be provided"),
        ({"query": "a", "label_token_ids": [1]}, "items must be provided"),
        ({**ok, "label_token_ids": [vocab]}, f"Token ID {vocab} is out of vocabulary"),
        ({**ok, "label_token_ids": [-1]}, "Token ID -1 is out of vocabulary"),
        ({**ok, "items": [[1, 2]]}, "Invalid combination of query/items types"),
        ({**ok, "query": [1, 2]}, "Invalid combination of query/items types"),
        ({**ok, "items": ["b", [1]]}, "items"),
        ({**ok, "return_pooled_hidden_states": True}, "hidden states"),
    ]
    for body, message in cases:
        r = client.post("/v1/score", json=body)
        assert r.status_code == 400 and message in r.json()["message"], (body, r.text)
    r = client.post("/v1/score", json={**ok, "items": []})
    assert r.status_code == 200 and r.json()["scores"] == []


def test_engine_score_is_sglangs_in_process_call_and_equals_v1_score(served, hf, path, tok):
    # SGLang's test_score_api.py: engine.score(query=..., items=..., label_token_ids=..., ...).
    engine, client, _ = served
    labels = [5, 17, 300]
    query, items = "The cat", [" sat", " ran far"]
    prompts = [tok(query + i)["input_ids"] for i in items]
    probs, _ = _hf_scores(hf, path, prompts, labels)
    got = engine.score(query=query, items=items, label_token_ids=labels)
    assert torch.allclose(torch.tensor(got), torch.tensor(probs, dtype=torch.float32), atol=1e-4)
    body = {"query": query, "items": items, "label_token_ids": labels}
    # Equal up to float32 rounding (the second call's prompts hit the prefix cache).
    over_http = client.post("/v1/score", json=body).json()["scores"]
    assert torch.allclose(torch.tensor(got), torch.tensor(over_http), atol=1e-6)
    ids_query, ids_items = [5, 60, 7], [[300, 42], [9]]
    want = _hf_scores(hf, path, [i + ids_query for i in ids_items], labels)[1]
    kwargs = dict(label_token_ids=labels, apply_softmax=True, item_first=True)
    got = asyncio.run(engine.async_score(query=ids_query, items=ids_items, **kwargs))
    assert torch.allclose(torch.tensor(got), torch.tensor(want, dtype=torch.float32), atol=1e-4)
    assert engine.score(query="a", items=[], label_token_ids=[1]) == []
    with pytest.raises(ValueError, match="label_token_ids must be provided"):
        engine.score(query="a", items=["b"])


def _greedy_text(hf, path, tok, messages: list[dict], max_new: int) -> tuple[str, int, int]:
    """(text, prompt tokens, output tokens) of transformers' greedy reply to the conversation."""
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    tokens, _ = hf.greedy(path, ids, max_new)
    return tok.decode(tokens, skip_special_tokens=True), len(ids), len(tokens)


def test_responses_answer_as_transformers_and_continue_a_stored_conversation(served, hf, path, tok):
    _, _, oai = served
    first = oai.responses.create(
        model="m",
        input="Hello there.",
        instructions="Be brief.",
        max_output_tokens=8,
        temperature=0,
    )
    messages = [{"role": "system", "content": "Be brief."}]
    messages.append({"role": "user", "content": "Hello there."})
    text, prompt_len, out_len = _greedy_text(hf, path, tok, messages, 8)
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.output_text == text and first.output[0].role == "assistant"
    # SGLang's status at max_output_tokens too, and both usage shapes its releases return.
    assert first.status == "completed" and first.incomplete_details is None
    assert first.usage.input_tokens == prompt_len and first.usage.output_tokens == out_len
    assert first.usage.prompt_tokens == prompt_len and first.usage.completion_tokens == out_len
    assert first.usage.total_tokens == prompt_len + out_len
    assert first.instructions == "Be brief." and first.max_output_tokens == 8
    assert oai.responses.retrieve(first.id).output_text == text

    # The next turn: the stored conversation, its answer, the new input; the new request's
    # instructions replace the old ones.
    second = oai.responses.create(
        model="m",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "More?"}]}],
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
        store=False,
    )
    messages = [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "More?"},
    ]
    text2, prompt_len2, _ = _greedy_text(hf, path, tok, messages, 6)
    assert second.output_text == text2 and second.usage.input_tokens == prompt_len2
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError, match=f"Response with id '{second.id}' not found"):
        oai.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError, match="Expected an ID that begins with 'resp'"):
        oai.responses.retrieve("nope")
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        oai.responses.cancel(first.id)


def test_responses_stream_sglangs_events(served):
    """Through the openai client's stream helper, as SGLang's test_response_stream reads it."""
    _, _, oai = served
    args = dict(model="m", input="Tell a story.", max_output_tokens=10, temperature=0)
    whole = oai.responses.create(**args)
    with oai.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == events[-4].text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[2].item.id == final.output[0].id == events[-2].item.id


def test_responses_refuse_what_they_cannot_serve(served):
    _, client, oai = served
    for extra, message in (
        ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "items"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input_image"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"previous_response_id": "resp_missing"}, "not found"),
        ({"unknown_field": 1}, "unknown_field"),
    ):
        r = client.post("/v1/responses", json={"input": "hi", **extra})
        assert r.status_code in (400, 404), r.text
        assert message in r.json()["error"]["message"], (extra, r.text)


def test_a_background_response_can_be_cancelled_while_queued(served):
    engine, client, oai = served
    blocker = engine.generate(input_ids=[5, 6, 7], sampling_params=LONG, stream=True)
    next(blocker)  # the only running slot is taken: the background request queues
    queued = oai.responses.create(model="m", input="Hi.", background=True, max_output_tokens=4)
    assert queued.status == "queued"
    cancelled = oai.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    engine.abort_request(abort_all=True)
    list(blocker)
    assert oai.responses.retrieve(queued.id).status == "cancelled"
    # Unblocked, a background response runs to the end and is stored.
    done = oai.responses.create(model="m", input="Hi.", background=True, max_output_tokens=4)
    for _ in range(200):
        got = oai.responses.retrieve(done.id)
        if got.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert got.status in ("completed", "incomplete") and got.usage.input_tokens > 0
    assert json.loads(got.model_dump_json())["id"] == done.id
