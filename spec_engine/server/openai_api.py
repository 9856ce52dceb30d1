"""The OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming
too), over the same Engine as the native API."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Optional

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from spec_engine.engine import Engine
from spec_engine.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from spec_engine.server.requests import (
    BadRequest,
    drop_unreachable_stop_ids,
    json_body,
    parse_model,
    sse,
    unless_disconnected,
)


def add_openai_routes(app: FastAPI, engine: Engine) -> None:
    model_name = engine.args.served_model_name
    _add_model_routes(app, engine, model_name)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_model(CompletionRequest, await json_body(request))
        return await _completions(engine, model_name, req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_model(ChatCompletionRequest, await json_body(request))
        return await _chat_completions(engine, model_name, req, request)


def _add_model_routes(app: FastAPI, engine: Engine, model_name: str) -> None:
    def model_card() -> dict:
        return {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "specrl",
            "root": model_name,
            "max_model_len": engine.context_len,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        if model != model_name:
            # OpenAI's (and SGLang's) error shape.
            return JSONResponse(
                {
                    "error": {
                        "message": f"The model {model!r} does not exist; this server serves "
                        f"{model_name!r}",
                        "type": "invalid_request_error",
                        "param": "model",
                        "code": "model_not_found",
                    }
                },
                status_code=404,
            )
        return model_card()


async def _completions(
    engine: Engine, model_name: str, req: CompletionRequest, request: Request
) -> Any:
    kwargs, prompts = _completion_arguments(req)
    vocab = engine.model_config.vocab_size
    kwargs["sampling_params"] = drop_unreachable_stop_ids(kwargs["sampling_params"], vocab)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
    if req.stream:
        return await _stream_completions(engine, req, kwargs, base, prompts)
    out = await unless_disconnected(request, engine.async_generate(**kwargs))
    if out is None:  # the client went away: its requests were aborted
        return Response(status_code=499)
    outs = _as_list(out)
    choices = []
    for i, o in enumerate(outs):
        echoed = _prompt_text(engine, prompts[i // req.n]) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = _completion_logprobs(engine, o, with_prompt=req.echo)
        choices.append(
            {
                "index": i,
                "text": echoed + o["text"],
                "finish_reason": _finish(o),
                "logprobs": logprobs,
            }
        )
    return {**base, "choices": choices, "usage": _usage(outs, req.n)}


def _completion_arguments(req: CompletionRequest) -> tuple[dict[str, Any], list[Any]]:
    """Engine.async_generate's keyword arguments for a completion request, and its prompts (one
    per choice group: text, or token ids)."""
    _refuse(best_of=req.best_of not in (None, 1), suffix=req.suffix is not None)
    prompt = req.prompt
    if isinstance(prompt, list) and not prompt:
        raise BadRequest(
            "prompt is an empty list; send a string, a list of strings, token ids or a "
            "list of token-id lists"
        )
    as_text = isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and isinstance(prompt[0], str)
    )
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise BadRequest(f"logprobs must be in [0, 20], got {req.logprobs}")
    kwargs = dict(
        prompt=prompt if as_text else None,
        input_ids=None if as_text else prompt,
        sampling_params=req.sampling_params(req.max_tokens),
        return_logprob=req.logprobs is not None,
        top_logprobs_num=req.logprobs or 0,
        rid=req.rid,
        custom_logit_processor=req.custom_logit_processor,
        # echo with logprobs scores the prompt too (OpenAI's first logprob is None).
        logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
    )
    prompts = (
        [prompt] if isinstance(prompt, str) or not isinstance(prompt[0], (str, list)) else prompt
    )
    return kwargs, prompts


async def _stream_completions(
    engine: Engine,
    req: CompletionRequest,
    kwargs: dict[str, Any],
    base: dict[str, Any],
    prompts: list[Any],
) -> StreamingResponse:
    stream = await engine.async_generate(stream=True, **kwargs)

    def choice(i: int, delta: str, finish: Optional[str], new: Optional[dict] = None) -> dict:
        logprobs = None
        if new is not None:
            echoed = "input_token_logprobs" in new["meta_info"]
            logprobs = _completion_logprobs(engine, new, with_prompt=echoed)
        return {"index": i, "text": delta, "logprobs": logprobs, "finish_reason": finish}

    def echo(i: int) -> str:
        return _prompt_text(engine, prompts[i // req.n])

    return StreamingResponse(
        _stream_events(
            stream,
            base,
            choice,
            _include_usage(req),
            req.n,
            echo=echo if req.echo else None,
        ),
        media_type="text/event-stream",
    )


async def _chat_completions(
    engine: Engine, model_name: str, req: ChatCompletionRequest, request: Request
) -> Any:
    top = req.top_logprobs or 0
    input_ids = _chat_input_ids(engine, req)
    if top and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs=true")
    kwargs = dict(
        input_ids=input_ids,
        sampling_params=drop_unreachable_stop_ids(
            req.sampling_params(req.max_completion_tokens or req.max_tokens),
            engine.model_config.vocab_size,
        ),
        return_logprob=req.logprobs,
        top_logprobs_num=top,
        rid=req.rid,
        custom_logit_processor=req.custom_logit_processor,
    )
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "chat.completion", "created": created, "model": model_name}
    if req.stream:
        return await _stream_chat(engine, req, kwargs, {**base, "object": "chat.completion.chunk"})
    out = await unless_disconnected(request, engine.async_generate(**kwargs))
    if out is None:  # the client went away: its requests were aborted
        return Response(status_code=499)
    outs = _as_list(out)
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


def _chat_input_ids(engine: Engine, req: ChatCompletionRequest) -> list[int]:
    """The messages through the model's chat template, as token ids."""
    _refuse(
        tools=bool(req.tools),
        tool_choice=req.tool_choice not in (None, "none"),
    )
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    return chat_input_ids(engine, messages, req.chat_template_kwargs)


def chat_input_ids(
    engine: Engine, messages: list[dict[str, str]], template_kwargs: Optional[dict[str, Any]]
) -> list[int]:
    """Chat messages through the model's chat template, as token ids."""
    if engine.tokenizer is None or engine.tokenizer.chat_template is None:
        raise BadRequest(
            "this model has no chat template; pass --chat-template or use /v1/completions"
        )
    try:
        text = engine.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=True,
            **(template_kwargs or {}),
        )
    except (jinja2.TemplateError, TypeError, ValueError) as e:
        raise BadRequest(f"the chat template could not render these messages: {e}") from None
    # The template already holds any special tokens it wants.
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


async def _stream_chat(
    engine: Engine, req: ChatCompletionRequest, kwargs: dict[str, Any], base: dict[str, Any]
) -> StreamingResponse:
    stream = await engine.async_generate(stream=True, **kwargs)

    def choice(i: int, delta: str, finish: Optional[str], new: Optional[dict] = None) -> dict:
        return {
            "index": i,
            "delta": _delta(None, delta or None),
            "logprobs": None if new is None else _chat_logprobs(engine, new),
            "finish_reason": finish,
        }

    first = [
        {
            "index": i,
            "delta": _delta("assistant", ""),
            "logprobs": None,
            "finish_reason": None,
        }
        for i in range(req.n)
    ]
    return StreamingResponse(
        # SGLang's serving_chat sends a chunk only with content (or a finish): every chat delta
        # after the first has text, which its own test_openai_server.py asserts.
        _stream_events(stream, base, choice, _include_usage(req), req.n, first, empty_deltas=False),
        media_type="text/event-stream",
    )


def _delta(role: Optional[str], content: Optional[str]) -> dict:
    """A chat chunk's delta as SGLang serializes its DeltaMessage: every key, null when empty
    (specrl parses no reasoning or tool calls, so those two are always null)."""
    return {"role": role, "content": content, "reasoning_content": None, "tool_calls": None}


def _include_usage(req: Any) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


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


def _prompt_text(engine: Engine, prompt: Any) -> str:
    """A prompt as echo shows it: the text, or token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    if engine.tokenizer is None:
        raise BadRequest("echo of token-id prompts needs a tokenizer; the server has none")
    return engine.tokenizer.decode(prompt)


def _completion_logprobs(engine: Engine, out: dict, with_prompt: bool = False) -> dict[str, Any]:
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs", [])
    tops = meta.get("output_top_logprobs", [[] for _ in entries])
    if with_prompt:
        prompt = meta.get("input_token_logprobs", [])
        entries = prompt + entries
        tops = meta.get("input_top_logprobs", [[] for _ in prompt]) + tops
        tops = [top or [] for top in tops]
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
    echo: Optional[Callable[[int], str]] = None,
    empty_deltas: bool = True,
) -> AsyncIterator[str]:
    """SSE chunks of text deltas; `choice(index, delta, finish_reason, new)` shapes each choice.
    With `echo`, each choice's first chunk starts with echo(index), its prompt (and, with
    log-probs, the prompt's log-probs). Without `empty_deltas`, a step whose text is held back
    (part of a UTF-8 character) sends no chunk: its log-probs go with the next one."""
    for c in first or []:
        yield sse({**base, "choices": [c]})
    sent: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finals: dict[int, dict] = {}
    try:
        async for out in stream:
            i = out.get("index", 0)
            echoing = echo is not None and i not in sent
            text = out["text"] or ""
            delta = text[sent.get(i, 0) :]
            sent[i] = len(text)
            if echoing:
                delta = echo(i) + delta
            finish = _finish(out)
            if finish is not None:
                finals[i] = out
            new = _new_logprobs(out, sent_tokens.get(i, 0), with_prompt=echoing)
            if not (delta or finish is not None or (new is not None and empty_deltas)):
                continue
            if new is not None:
                sent_tokens[i] = sent_tokens.get(i, 0) + len(
                    new["meta_info"]["output_token_logprobs"]
                )
            yield sse({**base, "choices": [choice(i, delta, finish, new)]})
    except Exception as e:  # the status line is sent already: report in-band
        yield sse(
            {"object": "error", "message": str(e), "type": "InternalServerError", "code": 500}
        )
    if include_usage:
        yield sse({**base, "choices": [], "usage": _usage([finals[i] for i in sorted(finals)], n)})
    yield "data: [DONE]\n\n"


def _new_logprobs(out: dict, sent: int, with_prompt: bool = False) -> Optional[dict]:
    """The part of a cumulative streamed output whose token log-probs were not sent yet (None
    without log-probs or new tokens); with_prompt adds the prompt's."""
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs")
    prompt = with_prompt and "input_token_logprobs" in meta
    if entries is None or (len(entries) <= sent and not prompt):
        return None
    new = {"output_token_logprobs": entries[sent:]}
    if "output_top_logprobs" in meta:
        new["output_top_logprobs"] = meta["output_top_logprobs"][sent:]
    if prompt:
        for key in ("input_token_logprobs", "input_top_logprobs"):
            if key in meta:
                new[key] = meta[key]
    return {"meta_info": new}


def token_text(engine: Engine, token_id: int) -> str:
    """A token's text (its id as text without a tokenizer)."""
    return engine.tokenizer.decode([token_id]) if engine.tokenizer is not None else str(token_id)
