"""HTTP API over an Engine: SGLang's native endpoints and the OpenAI-compatible ones.

Bad requests get HTTP 400 with a message naming the field; the engine keeps serving others.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import typing
import uuid
from typing import Any, AsyncIterator, Optional

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError

from spec_engine.engine import Engine
from spec_engine.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from spec_engine.weights.transport import deserialize_tensors

_GENERATE_KEYS = {"text", "input_ids", "sampling_params", "return_logprob", "top_logprobs_num", "stream", "rid",
                  "return_text_in_logprobs"}
HEALTH_TIMEOUT_S = 60.0


class BadRequest(ValueError):
    pass


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="spec_engine", version=engine.get_server_info()["version"])
    api_key = engine.args.api_key

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        # Health probes stay open, as in SGLang.
        if (api_key and request.url.path not in ("/health", "/health_generate")
                and request.headers.get("authorization") != f"Bearer {api_key}"):
            return JSONResponse({"error": {"message": "missing or wrong API key (send 'Authorization: Bearer <key>')"}},
                                status_code=401)
        return await call_next(request)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError):
        return _error(str(exc), request)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error(_describe_validation(exc.errors()), request)

    # ---------------------------------------------------------------- native endpoints

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        try:
            await asyncio.wait_for(engine.async_generate(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}),
                                   HEALTH_TIMEOUT_S)
        except Exception as e:
            return JSONResponse({"error": {"message": f"generation failed: {e!r}"}}, status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return engine.get_model_info()

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        return await asyncio.to_thread(engine.get_server_info)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await asyncio.to_thread(engine.flush_cache):
            return Response("Cache flushed.\n", status_code=200)
        return Response("Cache not flushed: requests are running or queued; retry when idle.\n", status_code=400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json_body(request)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise BadRequest("abort_request needs a string 'rid'")
        engine.abort_request(rid)
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(request: Request):
        body = await _json_body(request)
        unknown = set(body) - _GENERATE_KEYS
        if unknown:
            raise BadRequest(f"unknown field(s) {sorted(unknown)} in /generate; allowed: {sorted(_GENERATE_KEYS)}")
        with_text = bool(body.get("return_text_in_logprobs", False))
        kwargs = dict(prompt=body.get("text"), input_ids=body.get("input_ids"), sampling_params=body.get("sampling_params"),
                      return_logprob=body.get("return_logprob", False), top_logprobs_num=body.get("top_logprobs_num", 0),
                      rid=body.get("rid"))
        if body.get("stream", False):
            stream = await engine.async_generate(stream=True, **kwargs)

            async def events() -> AsyncIterator[str]:
                try:
                    async for out in stream:
                        yield _sse(_logprob_text(engine, out, with_text))
                except Exception as e:  # the status line is sent already: report in-band
                    yield _sse({"error": {"message": str(e)}})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        out = await engine.async_generate(**kwargs)
        if isinstance(out, list):
            return [_logprob_text(engine, o, with_text) for o in out]
        return _logprob_text(engine, out, with_text)

    # ---------------------------------------------------------------- weights and memory

    async def control(request: Request, method, keys: tuple[str, ...], convert=None):
        body = await _json_body(request)
        unknown = set(body) - set(keys)
        if unknown:
            raise BadRequest(f"unknown field(s) {sorted(unknown)}; allowed: {list(keys)}")
        _check_field_types(method, body)
        if convert is not None:
            body = convert(body)
        try:
            inspect.signature(method).bind(**body)
        except TypeError as e:  # a required field is missing
            raise BadRequest(str(e)) from None
        result = await asyncio.to_thread(method, **body)
        return result if isinstance(result, dict) else {"success": True}

    def tensors_from_text(body: dict) -> dict:
        if "serialized_named_tensors" not in body:
            raise BadRequest("serialized_named_tensors is required (spec_engine.weights.transport.serialize_tensors output)")
        body["named_tensors"] = deserialize_tensors(body.pop("serialized_named_tensors"))
        return body

    def control_endpoint(name: str) -> None:
        """POST /<name>: the engine method's keyword arguments as JSON fields (tensors travel as
        serialized_named_tensors, the text form of named_tensors)."""
        method = getattr(engine, name)
        keys = tuple("serialized_named_tensors" if k == "named_tensors" else k
                     for k in inspect.signature(method).parameters)
        convert = tensors_from_text if "serialized_named_tensors" in keys else None

        async def handler(request: Request):
            return await control(request, method, keys, convert)

        app.post(f"/{name}", name=name)(handler)

    for name in CONTROL_METHODS:
        control_endpoint(name)

    # ---------------------------------------------------------------- OpenAI-compatible

    model_name = engine.args.served_model_name

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                             "owned_by": "specrl", "max_model_len": engine.context_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _parse(CompletionRequest, await _json_body(request))
        _refuse(echo=req.echo, best_of=req.best_of not in (None, 1), suffix=req.suffix is not None,
                logit_bias=bool(req.logit_bias))
        prompt = req.prompt
        as_text = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str))
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise BadRequest(f"logprobs must be in [0, 20], got {req.logprobs}")
        if req.stream and req.logprobs is not None:
            raise BadRequest("logprobs are not streamed by specrl; use stream=false, or /generate with stream")
        kwargs = dict(prompt=prompt if as_text else None, input_ids=None if as_text else prompt,
                      sampling_params=req.sampling_params(req.max_tokens), return_logprob=req.logprobs is not None,
                      top_logprobs_num=req.logprobs or 0, rid=req.rid)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        if req.stream:
            stream = await engine.async_generate(stream=True, **kwargs)
            include_usage = req.stream_options is not None and req.stream_options.include_usage

            def choice(i: int, delta: str, finish: Optional[str]) -> dict:
                return {"index": i, "text": delta, "logprobs": None, "finish_reason": finish}

            return StreamingResponse(_stream_events(stream, base, choice, include_usage, req.n),
                                     media_type="text/event-stream")
        outs = _as_list(await engine.async_generate(**kwargs))
        choices = [{"index": i, "text": o["text"], "finish_reason": _finish(o),
                    "logprobs": _completion_logprobs(engine, o) if req.logprobs is not None else None}
                   for i, o in enumerate(outs)]
        return {**base, "choices": choices, "usage": _usage(outs, req.n)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = _parse(ChatCompletionRequest, await _json_body(request))
        _refuse(logit_bias=bool(req.logit_bias), response_format=req.response_format not in (None, {"type": "text"}),
                tools=bool(req.tools), tool_choice=req.tool_choice not in (None, "none"))
        if engine.tokenizer is None or engine.tokenizer.chat_template is None:
            raise BadRequest("this model has no chat template; pass --chat-template or use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                        **(req.chat_template_kwargs or {}))
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise BadRequest(f"the chat template could not render these messages: {e}") from None
        # The template already holds any special tokens it wants.
        input_ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true")
        if req.stream and req.logprobs:
            raise BadRequest("logprobs are not streamed by specrl; use stream=false, or /generate with stream")
        kwargs = dict(input_ids=list(input_ids), sampling_params=req.sampling_params(req.max_completion_tokens or req.max_tokens),
                      return_logprob=req.logprobs, top_logprobs_num=top, rid=req.rid)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": model_name}
        if req.stream:
            stream = await engine.async_generate(stream=True, **kwargs)
            include_usage = req.stream_options is not None and req.stream_options.include_usage

            def choice(i: int, delta: str, finish: Optional[str]) -> dict:
                return {"index": i, "delta": {"content": delta} if delta else {}, "logprobs": None, "finish_reason": finish}

            first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                     for i in range(req.n)]
            return StreamingResponse(_stream_events(stream, {**base, "object": "chat.completion.chunk"}, choice,
                                                    include_usage, req.n, first), media_type="text/event-stream")
        outs = _as_list(await engine.async_generate(**kwargs))
        choices = [{"index": i, "message": {"role": "assistant", "content": o["text"]}, "finish_reason": _finish(o),
                    "logprobs": _chat_logprobs(engine, o) if req.logprobs else None} for i, o in enumerate(outs)]
        return {**base, "choices": choices, "usage": _usage(outs, req.n)}

    return app


# -------------------------------------------------------------------- helpers


def _error(message: str, request: Request, status: int = 400) -> JSONResponse:
    if request.url.path.startswith("/v1/"):
        return JSONResponse({"object": "error", "message": message, "type": "BadRequestError", "param": None,
                             "code": status}, status_code=status)
    return JSONResponse({"error": {"message": message}}, status_code=status)


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the JSON body must be an object, got {type(body).__name__}")
    return body


def _parse(model: type, body: dict[str, Any]):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise BadRequest(_describe_validation(e.errors())) from None


def _describe_validation(errors: list[dict[str, Any]]) -> str:
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def _refuse(**unsupported: bool) -> None:
    for name, bad in unsupported.items():
        if bad:
            raise BadRequest(f"{name} is not supported by specrl; leave it unset")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _as_list(out: Any) -> list[dict]:
    return out if isinstance(out, list) else [out]


def _finish(out: dict) -> Optional[str]:
    reason = out["meta_info"]["finish_reason"]
    return None if reason is None else reason["type"]


def _usage(outs: list[dict], n: int) -> dict[str, int]:
    # Outputs come as n samples per prompt in a row; each prompt is counted once, as OpenAI does.
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs[::n])
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_str(engine: Engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id]) if engine.tokenizer is not None else str(token_id)


def _logprob_text(engine: Engine, out: dict, with_text: bool) -> dict:
    if not with_text:
        return out
    meta = out["meta_info"]
    if "output_token_logprobs" in meta:
        meta["output_token_logprobs"] = [(lp, t, _token_str(engine, t)) for lp, t, _ in meta["output_token_logprobs"]]
    if "output_top_logprobs" in meta:
        meta["output_top_logprobs"] = [[(lp, t, _token_str(engine, t)) for lp, t, _ in top] for top in meta["output_top_logprobs"]]
    return out


def _completion_logprobs(engine: Engine, out: dict) -> dict[str, Any]:
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs", [])
    tops = meta.get("output_top_logprobs", [[] for _ in entries])
    tokens = [_token_str(engine, t) for _, t, _ in entries]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in entries],
            "top_logprobs": [{_token_str(engine, t): lp for lp, t, _ in top} for top in tops], "text_offset": offsets}


def _chat_logprobs(engine: Engine, out: dict) -> dict[str, Any]:
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs", [])
    tops = meta.get("output_top_logprobs", [[] for _ in entries])
    content = []
    for (lp, t, _), top in zip(entries, tops):
        tok = _token_str(engine, t)
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": _token_str(engine, tt), "logprob": tl,
                                          "bytes": list(_token_str(engine, tt).encode())} for tl, tt, _ in top]})
    return {"content": content}


async def _stream_events(stream: AsyncIterator[dict], base: dict, choice: Any, include_usage: bool, n: int,
                         first: Optional[list[dict]] = None) -> AsyncIterator[str]:
    """SSE chunks of text deltas; `choice(index, delta, finish_reason)` shapes each choice."""
    for c in first or []:
        yield _sse({**base, "choices": [c]})
    sent: dict[int, int] = {}
    finals: dict[int, dict] = {}
    try:
        async for out in stream:
            i = out.get("index", 0)
            text = out["text"] or ""
            delta = text[sent.get(i, 0):]
            sent[i] = len(text)
            finish = _finish(out)
            if finish is not None:
                finals[i] = out
            if delta or finish is not None:
                yield _sse({**base, "choices": [choice(i, delta, finish)]})
    except Exception as e:  # the status line is sent already: report in-band
        yield _sse({"object": "error", "message": str(e), "type": "InternalServerError", "code": 500})
    if include_usage:
        yield _sse({**base, "choices": [], "usage": _usage([finals[i] for i in sorted(finals)], n)})
    yield "data: [DONE]\n\n"


CONTROL_METHODS = ("update_weights_from_tensor", "init_weights_update_group", "update_weights_from_distributed",
                   "update_weights_from_disk", "get_weights_checksum", "pause_generation", "continue_generation",
                   "release_memory_occupation", "resume_memory_occupation")


def _check_field_types(method, body: dict) -> None:
    """Each JSON field must match the engine method's annotation (strictly: "8" is no int)."""
    hints = typing.get_type_hints(method)
    for key, value in body.items():
        if key in hints:
            try:
                TypeAdapter(hints[key]).validate_python(value, strict=True)
            except ValidationError:
                expected = getattr(hints[key], "__name__", str(hints[key]).replace("typing.", ""))
                raise BadRequest(f"field {key!r} must be {expected}, got {value!r:.80}") from None

