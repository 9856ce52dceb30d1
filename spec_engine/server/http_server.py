"""HTTP API over an Engine: SGLang's native endpoints and the OpenAI-compatible ones.

Bad requests get HTTP 400 with a message naming the field; the engine keeps serving others.
"""

from __future__ import annotations

import asyncio
import inspect
import typing
import uuid
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from spec_engine.control_methods import CONTROL_METHODS, ControlMethod
from spec_engine.core.outputs import EngineFailure
from spec_engine.core.stats import HEALTH_CHECK_RID_PREFIX
from spec_engine.engine import Engine
from spec_engine.server.admin_api import add_admin_routes
from spec_engine.server.openai_api import add_openai_routes, token_text
from spec_engine.server.requests import (
    BadRequest,
    PayloadTooLarge,
    describe_validation,
    drop_unreachable_stop_ids,
    error_response,
    json_body,
    sse,
    unless_disconnected,
)
from spec_engine.server.responses_api import add_responses_routes
from spec_engine.server.score_api import add_score_route
from spec_engine.version import __version__
from spec_engine.weights.formats import tensors_from_text

_GENERATE_KEYS = {
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "token_ids_logprob",
    "stream",
    "rid",
    "return_text_in_logprobs",
    "log_metrics",
    "return_routed_experts",
    "routed_experts_start_len",
    "custom_logit_processor",
}
# SGLang GenerateReqInput fields specrl has no use for: accepted at their neutral value (what
# clients send by default), refused otherwise with the reason.
_GENERATE_NEUTRAL = {
    "return_hidden_states": (False, "hidden states are not returned by specrl"),
    "return_entropy": (False, "entropies are not returned by specrl; use top_logprobs_num"),
    "input_embeds": (None, "specrl takes text or input_ids, not embeddings"),
    "positional_embed_overrides": (None, "specrl takes text or input_ids, not embeddings"),
    "image_data": (None, "specrl serves text-only models"),
    "video_data": (None, "specrl serves text-only models"),
    "audio_data": (None, "specrl serves text-only models"),
    "modalities": (None, "specrl serves text-only models"),
    "lora_path": (None, "specrl serves no LoRA adapters"),
    "lora_id": (None, "specrl serves no LoRA adapters"),
    "session_params": (None, "sessions are not supported by specrl"),
    "bootstrap_host": (None, "specrl has no prefill/decode disaggregation"),
    "bootstrap_port": (None, "specrl has no prefill/decode disaggregation"),
    "bootstrap_room": (None, "specrl has no prefill/decode disaggregation"),
    "bootstrap_pair_key": (None, "specrl has no prefill/decode disaggregation"),
    "data_parallel_rank": (None, "a specrl server is one data-parallel rank"),
    "routed_dp_rank": (None, "a specrl server is one data-parallel rank"),
    "priority": (None, "requests are served first come, first served (no priorities)"),
    "extra_key": (None, "the prefix cache is shared by every request (no per-request salt)"),
    "cache_salt": (None, "the prefix cache is shared by every request (no per-request salt)"),
    "return_prompt_token_ids": (False, "prompt_token_ids are not returned; use /tokenize"),
}
HEALTH_TIMEOUT_S = 60.0
# Control routes whose failure SGLang answers with its result body, success false, and a 400
# (http_server.update_weights_from_disk), not with an error object.
_FAILS_WITH_SUCCESS_FALSE = {"update_weights_from_disk"}


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="spec_engine", version=__version__)
    app.state.max_request_bytes = engine.args.max_request_bytes
    _add_api_key_check(app, engine.args.api_key)
    _add_error_responses(app)
    _add_native_routes(app, engine)
    _add_generate_route(app, engine)
    for method in CONTROL_METHODS:
        if method.http:
            _add_control_route(app, engine, method)
    add_admin_routes(app, engine)
    add_openai_routes(app, engine)
    add_responses_routes(app, engine)
    add_score_route(app, engine)
    return app


def _add_api_key_check(app: FastAPI, api_key: Optional[str]) -> None:
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)


class ApiKeyCheck:
    """401 for a request without 'Authorization: Bearer <key>'; health probes stay open, as in
    SGLang. A plain ASGI middleware: Starlette's @app.middleware("http") (BaseHTTPMiddleware)
    hides the client's http.disconnect from request.is_disconnected(), so a dropped client's
    request ran on."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and Request(scope).url.path not in ("/health", "/health_generate")
            and Headers(scope=scope).get("authorization") != self.expected
        ):
            message = "missing or wrong API key (send 'Authorization: Bearer <key>')"
            response = JSONResponse({"error": {"message": message}}, status_code=401)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _add_error_responses(app: FastAPI) -> None:
    @app.exception_handler(ValueError)
    async def valueerror_response(request: Request, exc: ValueError):
        status = 413 if isinstance(exc, PayloadTooLarge) else 400
        return error_response(str(exc), request, status)

    @app.exception_handler(EngineFailure)
    async def enginefailure_response(request: Request, exc: EngineFailure):
        # The engine failed this request (its step raised, or it produced non-finite values):
        # a 500 that says so, never a misleading 400.
        if exc.status_code != 500:  # a request timeout: SGLang's HTTPException body
            return JSONResponse(
                {
                    "object": "error",
                    "message": str(exc),
                    "type": HTTPStatus(exc.status_code).phrase,
                    "param": None,
                    "code": exc.status_code,
                },
                status_code=exc.status_code,
            )
        return error_response(str(exc), request, 500)

    @app.exception_handler(RequestValidationError)
    async def validationerror_response(request: Request, exc: RequestValidationError):
        return error_response(describe_validation(exc.errors()), request)


def _add_native_routes(app: FastAPI, engine: Engine) -> None:
    """SGLang's health, model info, cache flush and abort endpoints."""

    @app.get("/health")
    async def health() -> Response:
        if engine.stopped_by is not None:  # a tensor-parallel rank died: the engine stopped
            return JSONResponse({"error": {"message": engine.stopped_by}}, status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        blocked = await asyncio.to_thread(engine.generation_blocked)
        if blocked is not None:  # it would only wait: say why at once
            return JSONResponse({"error": {"message": blocked}}, status_code=503)
        try:
            await asyncio.wait_for(
                engine.async_generate(
                    input_ids=[0],
                    sampling_params={"max_new_tokens": 1, "temperature": 0},
                    rid=f"{HEALTH_CHECK_RID_PREFIX}{uuid.uuid4().hex}",
                ),
                HEALTH_TIMEOUT_S,
            )
        except Exception as e:
            return JSONResponse(
                {"error": {"message": f"generation failed: {e!r}"}}, status_code=503
            )
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return engine.get_model_info()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await asyncio.to_thread(engine.flush_cache):
            return Response("Cache flushed.\n", status_code=200)
        return Response(
            "Cache not flushed: requests are running or queued; retry when idle.\n", status_code=400
        )

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_body(request)
        unknown = set(body) - {"rid", "abort_all", "abort_message"}
        if unknown:
            raise BadRequest(f"unknown field(s) {sorted(unknown)}; allowed: rid, abort_all")
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not isinstance(abort_all, bool):
            raise BadRequest(f"abort_all must be true or false, got {abort_all!r}")
        if not abort_all and not isinstance(rid, str):
            raise BadRequest("abort_request needs a string 'rid', or 'abort_all': true")
        message = body.get("abort_message")  # None: SGLang's wording (see Scheduler.abort)
        engine.abort_request(rid, abort_all=abort_all, message=str(message) if message else None)
        return Response(status_code=200)


def _add_generate_route(app: FastAPI, engine: Engine) -> None:
    @app.post("/generate")
    async def generate(request: Request):
        body = await json_body(request)
        kwargs, with_text = _generate_arguments(body)
        vocab = engine.model_config.vocab_size
        kwargs["sampling_params"] = drop_unreachable_stop_ids(kwargs["sampling_params"], vocab)
        if body.get("stream", False):
            stream = await engine.async_generate(stream=True, **kwargs)
            segments = IncrementalSegments() if engine.args.incremental_streaming_output else None

            async def events() -> AsyncIterator[str]:
                try:
                    async for out in stream:
                        if segments is not None:
                            out = segments.cut(out)
                        yield sse(_logprob_text(engine, out, with_text))
                except Exception as e:  # the status line is sent already: report in-band
                    yield sse({"error": {"message": str(e)}})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        out = await unless_disconnected(request, engine.async_generate(**kwargs))
        if out is None:  # the client went away: its requests were aborted
            return Response(status_code=499)
        if isinstance(out, list):
            return [_logprob_text(engine, o, with_text) for o in out]
        return _logprob_text(engine, out, with_text)


def _generate_arguments(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """/generate's body as Engine.async_generate's keyword arguments (stream aside), and
    return_text_in_logprobs; refuses unknown fields and SGLang's at a value specrl cannot serve."""
    unknown = set(body) - _GENERATE_KEYS - set(_GENERATE_NEUTRAL)
    if unknown:
        raise BadRequest(
            f"unknown field(s) {sorted(unknown)} in /generate; allowed: "
            f"{sorted(_GENERATE_KEYS | set(_GENERATE_NEUTRAL))}"
        )
    for key, (neutral, why) in _GENERATE_NEUTRAL.items():
        if key in body and body[key] not in (neutral, None):
            raise BadRequest(f"{key}: {why} (got {body[key]!r:.80}; leave it out)")
    with_text = body.get("return_text_in_logprobs", False)
    if not isinstance(with_text, bool):
        raise BadRequest(f"return_text_in_logprobs must be true or false, got {with_text!r:.80}")
    kwargs = dict(
        prompt=body.get("text"),
        input_ids=body.get("input_ids"),
        sampling_params=body.get("sampling_params"),
        return_logprob=body.get("return_logprob", False),
        top_logprobs_num=body.get("top_logprobs_num", 0),
        rid=body.get("rid"),
        logprob_start_len=body.get("logprob_start_len", -1),
        token_ids_logprob=body.get("token_ids_logprob"),
        # null means the default, as SGLang's optional fields read it
        return_routed_experts=body.get("return_routed_experts") or False,
        routed_experts_start_len=body.get("routed_experts_start_len") or 0,
        custom_logit_processor=body.get("custom_logit_processor"),
    )
    return kwargs, with_text


def _add_control_route(app: FastAPI, engine: Engine, control: ControlMethod) -> None:
    """/<name>: the engine method's keyword arguments as JSON fields (tensors travel as
    serialized_named_tensors, the text form of named_tensors)."""
    method = getattr(engine, control.name)
    keys = control_fields(method)
    convert = tensors_from_text if "serialized_named_tensors" in keys else None

    async def handler(request: Request):
        body = await json_body(request)
        unknown = set(body) - set(keys)
        if unknown:
            raise BadRequest(f"unknown field(s) {sorted(unknown)}; allowed: {list(keys)}")
        if convert is not None:
            body = convert(body)
        _check_field_types(method, body)
        try:
            inspect.signature(method).bind(**body)
        except TypeError as e:  # a required field is missing
            raise BadRequest(str(e)) from None
        try:
            result = await asyncio.to_thread(method, **body)
        except ValueError as e:
            if control.name not in _FAILS_WITH_SUCCESS_FALSE:
                raise
            return JSONResponse(
                {"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400
            )
        if not isinstance(result, dict):
            return {"success": True}
        # SGLang answers a failed check (weights_checker compare) with its body and a 400.
        return JSONResponse(result, status_code=400 if result.get("success") is False else 200)

    app.api_route(f"/{control.name}", methods=list(control.http), name=control.name)(handler)


def control_fields(method: Callable[..., Any]) -> tuple[str, ...]:
    """The JSON fields of a control route: the method's parameters, named_tensors sent as
    serialized_named_tensors."""
    return tuple(
        dict.fromkeys(
            "serialized_named_tensors" if k == "named_tensors" else k
            for k in inspect.signature(method).parameters
        )
    )


# -------------------------------------------------------------------- helpers


class IncrementalSegments:
    """--incremental-streaming-output: each streamed chunk cut down to what is new since the
    previous chunk of its request (SGLang's tokenizer manager: text, output_ids and the output
    log-prob lists as deltas; everything else in meta_info as it is)."""

    _META_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, int]] = {}  # batch index -> (text chars, output ids)

    def cut(self, out: dict) -> dict:
        chars, ids = self._sent.get(out.get("index", 0), (0, 0))
        text, output_ids = out.get("text"), out["output_ids"]
        self._sent[out.get("index", 0)] = (len(text or ""), len(output_ids))
        meta = dict(out["meta_info"])
        for key in self._META_KEYS:
            if key in meta:
                meta[key] = meta[key][ids:]
        cut = {**out, "output_ids": output_ids[ids:], "meta_info": meta}
        if text is not None:
            cut["text"] = text[chars:]
        return cut


def _logprob_text(engine: Engine, out: dict, with_text: bool) -> dict:
    if not with_text:
        return out
    meta = out["meta_info"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        if key in meta:
            meta[key] = [(lp, t, token_text(engine, t)) for lp, t, _ in meta[key]]
    for key in (
        "output_top_logprobs",
        "input_top_logprobs",
        "output_token_ids_logprobs",
        "input_token_ids_logprobs",
    ):
        if key in meta:
            meta[key] = [
                None if top is None else [(lp, t, token_text(engine, t)) for lp, t, _ in top]
                for top in meta[key]
            ]
    return out


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
