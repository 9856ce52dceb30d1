"""SGLang's /v1/score: the route, its body's checks and its response; the scores themselves
come from core/scoring.py, which Engine.score shares."""

from __future__ import annotations

from typing import Any, Union

from fastapi import FastAPI, Request
from fastapi.responses import Response

from spec_engine.core.scoring import label_scores, score_generate_kwargs
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
    return score_generate_kwargs(
        req.query, req.items, req.label_token_ids, req.item_first, engine.model_config.vocab_size
    )


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
