"""The OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming
too), over the same Engine as the native API."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Optional

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from spec_engine.engine import Engine
from spec_engine.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from spec_engine.server.requests import BadRequest, json_body, parse_model, sse


def add_openai_routes(app: FastAPI, engine: Engine) -> None:
    model_name = engine.args.served_model_name

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "specrl",
                    "max_model_len": engine.context_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_model(CompletionRequest, await json_body(request))
        _refuse(
            echo=req.echo,
            best_of=req.best_of not in (None, 1),
            suffix=req.suffix is not None,
            logit_bias=bool(req.logit_bias),
        )
        prompt = req.prompt
        as_text = isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and isinstance(prompt[0], str)
        )
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise BadRequest(f"logprobs must be in [0, 20], got {req.logprobs}")
        if req.stream and req.logprobs is not None:
            raise BadRequest(
                "logprobs are not streamed by specrl; use stream=false, or /generate with stream"
            )
        kwargs = dict(
            prompt=prompt if as_text else None,
            input_ids=None if as_text else prompt,
            sampling_params=req.sampling_params(req.max_tokens),
            return_logprob=req.logprobs is not None,
            top_logprobs_num=req.logprobs or 0,
            rid=req.rid,
        )
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        if req.stream:
            stream = await engine.async_generate(stream=True, **kwargs)
            include_usage = req.stream_options is not None and req.stream_options.include_usage

            def choice(i: int, delta: str, finish: Optional[str]) -> dict:
                return {"index": i, "text": delta, "logprobs": None, "finish_reason": finish}

            return StreamingResponse(
                _stream_events(stream, base, choice, include_usage, req.n),
                media_type="text/event-stream",
            )
        outs = _as_list(await engine.async_generate(**kwargs))
        choices = [
            {
                "index": i,
                "text": o["text"],
                "finish_reason": _finish(o),
                "logprobs": _completion_logprobs(engine, o) if req.logprobs is not None else None,
            }
            for i, o in enumerate(outs)
        ]
        return {**base, "choices": choices, "usage": _usage(outs, req.n)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_model(ChatCompletionRequest, await json_body(request))
        _refuse(
            logit_bias=bool(req.logit_bias),
            response_format=req.response_format not in (None, {"type": "text"}),
            tools=bool(req.tools),
            tool_choice=req.tool_choice not in (None, "none"),
        )
        if engine.tokenizer is None or engine.tokenizer.chat_template is None:
            raise BadRequest(
                "this model has no chat template; pass --chat-template or use /v1/completions"
            )
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = engine.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=True,
                **(req.chat_template_kwargs or {}),
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise BadRequest(f"the chat template could not render these messages: {e}") from None
        # The template already holds any special tokens it wants.
        input_ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true")
        if req.stream and req.logprobs:
            raise BadRequest(
                "logprobs are not streamed by specrl; use stream=false, or /generate with stream"
            )
        kwargs = dict(
            input_ids=list(input_ids),
            sampling_params=req.sampling_params(req.max_completion_tokens or req.max_tokens),
            return_logprob=req.logprobs,
            top_logprobs_num=top,
            rid=req.rid,
        )
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": model_name}
        if req.stream:
            stream = await engine.async_generate(stream=True, **kwargs)
            include_usage = req.stream_options is not None and req.stream_options.include_usage

            def choice(i: int, delta: str, finish: Optional[str]) -> dict:
                return {
                    "index": i,
                    "delta": {"content": delta} if delta else {},
                    "logprobs": None,
                    "finish_reason": finish,
                }

            first = [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(req.n)
            ]
            return StreamingResponse(
                _stream_events(
                    stream,
                    {**base, "object": "chat.completion.chunk"},
                    choice,
                    include_usage,
                    req.n,
                    first,
                ),
                media_type="text/event-stream",
            )
        outs = _as_list(await engine.async_generate(**kwargs))
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": o["text"]},
                "finish_reason": _finish(o),
                "logprobs": _chat_logprobs(engine, o) if req.logprobs else None,
            }
            for i, o in enumerate(outs)
        ]
        return {**base, "choices": choices, "usage": _usage(outs, req.n)}


def _refuse(**unsupported: bool) -> None:
    for name, bad in unsupported.items():
        if bad:
            raise BadRequest(f"{name} is not supported by specrl; leave it unset")


def _as_list(out: Any) -> list[dict]:
    return out if isinstance(out, list) else [out]


def _finish(out: dict) -> Optional[str]:
    reason = out["meta_info"]["finish_reason"]
    return None if reason is None else reason["type"]


def _usage(outs: list[dict], n: int) -> dict[str, int]:
    # Outputs come as n samples per prompt in a row; each prompt is counted once, as OpenAI does.
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs[::n])
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _completion_logprobs(engine: Engine, out: dict) -> dict[str, Any]:
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs", [])
    tops = meta.get("output_top_logprobs", [[] for _ in entries])
    tokens = [token_text(engine, t) for _, t, _ in entries]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _, _ in entries],
        "top_logprobs": [{token_text(engine, t): lp for lp, t, _ in top} for top in tops],
        "text_offset": offsets,
    }


def _chat_logprobs(engine: Engine, out: dict) -> dict[str, Any]:
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs", [])
    tops = meta.get("output_top_logprobs", [[] for _ in entries])
    content = []
    for (lp, t, _), top in zip(entries, tops):
        tok = token_text(engine, t)
        content.append(
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {
                        "token": token_text(engine, tt),
                        "logprob": tl,
                        "bytes": list(token_text(engine, tt).encode()),
                    }
                    for tl, tt, _ in top
                ],
            }
        )
    return {"content": content}


async def _stream_events(
    stream: AsyncIterator[dict],
    base: dict,
    choice: Any,
    include_usage: bool,
    n: int,
    first: Optional[list[dict]] = None,
) -> AsyncIterator[str]:
    """SSE chunks of text deltas; `choice(index, delta, finish_reason)` shapes each choice."""
    for c in first or []:
        yield sse({**base, "choices": [c]})
    sent: dict[int, int] = {}
    finals: dict[int, dict] = {}
    try:
        async for out in stream:
            i = out.get("index", 0)
            text = out["text"] or ""
            delta = text[sent.get(i, 0) :]
            sent[i] = len(text)
            finish = _finish(out)
            if finish is not None:
                finals[i] = out
            if delta or finish is not None:
                yield sse({**base, "choices": [choice(i, delta, finish)]})
    except Exception as e:  # the status line is sent already: report in-band
        yield sse(
            {"object": "error", "message": str(e), "type": "InternalServerError", "code": 500}
        )
    if include_usage:
        yield sse({**base, "choices": [], "usage": _usage([finals[i] for i in sorted(finals)], n)})
    yield "data: [DONE]\n\n"


def token_text(engine: Engine, token_id: int) -> str:
    """A token's text (its id as text without a tokenizer)."""
    return engine.tokenizer.decode([token_id]) if engine.tokenizer is not None else str(token_id)
