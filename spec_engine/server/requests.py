"""What every endpoint shares: reading a JSON body, validating it against a model, the 400
errors that name the bad field, server-sent events, and aborting the work of a client that
disconnected."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any, Optional, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

T = TypeVar("T")
logger = logging.getLogger(__name__)
# How often a request waiting on the engine checks that its client is still connected.
DISCONNECT_POLL_S = 0.1


class BadRequest(ValueError):
    pass


class PayloadTooLarge(BadRequest):
    """Answered with 413."""


def error_response(message: str, request: Request, status: int = 400) -> JSONResponse:
    if request.url.path.startswith("/v1/"):
        return JSONResponse(
            {
                "object": "error",
                "message": message,
                "type": "BadRequestError",
                "param": None,
                "code": status,
            },
            status_code=status,
        )
    return JSONResponse({"error": {"message": message}}, status_code=status)


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object, read up to the server's body limit (413 past it, before the
    rest is read)."""
    limit = request.app.state.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(_too_large(int(declared), limit))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(_too_large(size, limit))
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise BadRequest("the JSON body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the JSON body must be an object, got {type(body).__name__}")
    return body


def _too_large(size: int, limit: int) -> str:
    return (
        f"the request body has {size} bytes or more, above the server's limit of {limit}; raise "
        "--max-request-bytes, or send less"
    )


def parse_model(model: type, body: dict[str, Any]):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise BadRequest(describe_validation(e.errors())) from None


def describe_validation(errors: list[dict[str, Any]]) -> str:
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def drop_unreachable_stop_ids(sampling_params: Any, vocab_size: int) -> Any:
    """`sampling_params` (one dict, or a list of them) without the `stop_token_ids` at or past
    the vocabulary: the model cannot produce them, and SGLang's SamplingParams keeps any int
    there (its own tests stop on Llama-3's id 119690 with every model), so they are ignored
    rather than refused."""
    if isinstance(sampling_params, list):
        return [drop_unreachable_stop_ids(p, vocab_size) for p in sampling_params]
    ids = sampling_params.get("stop_token_ids") if isinstance(sampling_params, dict) else None
    if isinstance(ids, list):
        kept = [t for t in ids if not (isinstance(t, int) and t >= vocab_size)]
        if len(kept) != len(ids):
            return {**sampling_params, "stop_token_ids": kept}
    return sampling_params


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> Optional[T]:
    """Await `work`, cancelling it when the client disconnects first (an async_generate call
    then aborts its requests, and their KV returns to the pool); None in that case."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                # SGLang's words for it (TokenizerManager): its own test_abort.py looks for
                # "Abort" in the server log; the engine then logs each request it aborts.
                logger.info(
                    "Request is disconnected from the client side. Abort request: %s %s",
                    request.method,
                    request.url.path,
                )
                return None
    finally:
        if not task.done():  # the client left, or this handler was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
