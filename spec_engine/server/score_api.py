"""SGLang's /v1/score: for each item, the probability of each label token at the next position
after query + item (or item + query), as SGLang's TokenizerManager.score_request computes it.

Each (query, item) pair is one prompt; its next-token log-probs over the whole vocabulary come
from one forward (a one-token generation with every top log-prob returned), and the labels' are
picked from them: exp(logprob) (the full-vocabulary probability), or with apply_softmax a softmax
over the labels' log-probs only (the same as a softmax over their logits).
"""

from __future__ import annotations

import math
from typing import Any, Union

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from spec_engine.engine import Engine
from spec_engine.server.openai_protocol import ScoringRequest
from spec_engine.server.requests import BadRequest, json_body, parse_model, unless_disconnected

# SGLang fields with no use here: refused unless at their neutral value.
_NEUTRAL = {
    "return_pooled_hidden_states": (False, "hidden states are not returned by specrl"),
    "embed_override_token_id": (None, "specrl takes text or token ids, not embeddings"),
    "query_embed_overrides": (None, "specrl takes text or token ids, not embeddings"),
    "item_embed_overrides": (None, "specrl takes text or token ids, not embeddings"),
}


def add_score_route(app: FastAPI, engine: Engine) -> None:
    model_name = engine.args.served_model_name

    @app.post("/v1/score")
    async def score(request: Request):
        req = parse_model(ScoringRequest, await json_body(request))
        kwargs = score_arguments(engine, req)
        if kwargs is None:  # no items: SGLang answers an empty list
            return _response([], 0, req.model or model_name)
        out = await unless_disconnected(request, engine.async_generate(**kwargs))
        if out is None:  # the client went away: its requests were aborted
            return Response(status_code=499)
        outs = out if isinstance(out, list) else [out]
        scores = [label_scores(o, req.label_token_ids, req.apply_softmax) for o in outs]
        prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
        return _response(scores, prompt_tokens, req.model or model_name)


def score_arguments(engine: Engine, req: ScoringRequest) -> Union[dict[str, Any], None]:
    """Engine.async_generate's keyword arguments scoring every item (None for no items); refuses
    what SGLang refuses, with its messages."""
    for key, (neutral, why) in _NEUTRAL.items():
        if getattr(req, key) != neutral:
            raise BadRequest(f"{key}: {why} (leave it out)")
    if req.label_token_ids is None:
        raise BadRequest("label_token_ids must be provided")
    if req.items is None:
        raise BadRequest("items must be provided")
    if not req.items:
        return None
    vocab = engine.model_config.vocab_size
    for token_id in req.label_token_ids:
        # SGLang checks the upper end only (a negative id fails later, as a 500 there).
        if not 0 <= token_id < vocab:
            raise BadRequest(f"Token ID {token_id} is out of vocabulary (vocab size: {vocab})")
    query, items = req.query, req.items
    if isinstance(query, str) and (isinstance(items, str) or isinstance(items[0], str)):
        texts = [items] if isinstance(items, str) else items
        pair = (lambda item: item + query) if req.item_first else (lambda item: query + item)
        prompts: dict[str, Any] = {"prompt": [pair(item) for item in texts]}
    elif isinstance(query, list) and isinstance(items, list) and isinstance(items[0], list):
        pair = (lambda item: item + query) if req.item_first else (lambda item: query + item)
        prompts = {"input_ids": [pair(item) for item in items]}
    else:
        raise BadRequest("Invalid combination of query/items types for score_request.")
    return dict(
        **prompts,
        # One token's log-probs over the whole vocabulary: the next position after the prompt.
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        top_logprobs_num=vocab,
    )


def label_scores(out: dict, label_token_ids: list[int], apply_softmax: bool) -> list[float]:
    """The labels' scores from one prompt's first output position (SGLang's
    _convert_logprobs_to_scores)."""
    top = out["meta_info"]["output_top_logprobs"][0]
    logprobs = {token: logprob for logprob, token, _ in top}
    picked = [logprobs.get(token, float("-inf")) for token in label_token_ids]
    if apply_softmax:
        return torch.softmax(torch.tensor(picked, dtype=torch.float64, device="cpu"), 0).tolist()
    return [math.exp(lp) for lp in picked]


def _response(scores: list[list[float]], prompt_tokens: int, model: str) -> dict:
    return {
        "scores": scores,
        "model": model,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "total_tokens": prompt_tokens,
        },
        "object": "scoring",
    }
