"""SGLang's Responses API (serving_responses.py, for a model without tool or reasoning parsers):
POST /v1/responses (answered whole, streamed as OpenAI's typed events, or run in the background),
GET /v1/responses/{id}, POST /v1/responses/{id}/cancel, and previous_response_id continuing a
stored conversation.

Errors answer in SGLang's shape for this API, {"error": {"message", "type", "param", "code"}}.
Stored responses live in the server's memory (as in SGLang), the oldest dropped past
MAX_STORED_RESPONSES.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from spec_engine.engine import Engine
from spec_engine.server.openai_api import chat_input_ids
from spec_engine.server.openai_protocol import ResponsesRequest
from spec_engine.server.requests import (
    BadRequest,
    PayloadTooLarge,
    json_body,
    parse_model,
    unless_disconnected,
)

MAX_STORED_RESPONSES = 10_000
# SGLang's ResponsesRequest._DEFAULT_SAMPLING_PARAMS for what the request leaves unset.
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 1.0
_TEXT_PARTS = ("input_text", "output_text", "text")
# SGLang's extension fields with no use here: refused unless at their neutral value.
_NEUTRAL = {
    "include": (None, "no includes are returned (output log-probs among them)"),
    "top_logprobs": (0, "output log-probs are not returned; use /v1/chat/completions"),
    "max_tool_calls": (None, "specrl parses no tool calls"),
    "priority": (0, "requests are served first come, first served (no priorities)"),
    "session_id": (None, "sessions are not supported by specrl"),
    "extra_key": (None, "the prefix cache is shared by every request (no per-request salt)"),
    "cache_salt": (None, "the prefix cache is shared by every request (no per-request salt)"),
}


class ResponseStore:
    """Stored responses by id, each with the input messages it answered (what a later
    previous_response_id continues from), and the background runs still going."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self.tasks: dict[str, asyncio.Task] = {}

    def put(self, response: dict, messages: list[dict]) -> None:
        self._responses[response["id"]] = (response, messages)
        self._responses.move_to_end(response["id"])
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]]:
        """(response, its input messages); SGLang's 400 for an id not starting with "resp", its
        404 for one not stored."""
        if not response_id.startswith("resp"):
            raise ResponsesError(
                f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.",
                param="response_id",
            )
        if response_id not in self._responses:
            raise ResponsesError(
                f"Response with id '{response_id}' not found.", 404, param="response_id"
            )
        return self._responses[response_id]


class ResponsesError(Exception):
    def __init__(self, message: str, status: int = 400, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param

    def response(self) -> JSONResponse:
        body = {
            "message": str(self),
            "type": "invalid_request_error",
            "param": self.param,
            "code": self.status,
        }
        return JSONResponse({"error": body}, status_code=self.status)


def add_responses_routes(app: FastAPI, engine: Engine) -> None:
    store = ResponseStore()
    model_name = engine.args.served_model_name

    @app.post("/v1/responses")
    async def create(request: Request):
        try:
            req = parse_model(ResponsesRequest, await json_body(request))
            run = _Run.prepare(engine, store, req, model_name)
            if req.background:  # SGLang: background wins over stream
                return run.start_background()
            if req.stream:
                return StreamingResponse(await run.stream_events(), media_type="text/event-stream")
            return await run.answer(request)
        except ResponsesError as e:
            return e.response()
        except ValueError as e:  # BadRequest, and the engine's refusals
            return ResponsesError(str(e), 413 if isinstance(e, PayloadTooLarge) else 400).response()

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        try:
            return store.get(response_id)[0]
        except ResponsesError as e:
            return e.response()

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str):
        try:
            response = store.get(response_id)[0]
        except ResponsesError as e:
            return e.response()
        if response["status"] not in ("queued", "in_progress"):
            return ResponsesError("Cannot cancel a synchronous response.").response()
        response["status"] = "cancelled"
        engine.abort_request(rid=response_id)
        task = store.tasks.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return response


class _Run:
    """One /v1/responses request: its conversation as token ids, its sampling params, and the
    response object it builds."""

    def __init__(
        self,
        engine: Engine,
        store: ResponseStore,
        req: ResponsesRequest,
        model: str,
        messages: list[dict],
        input_ids: list[int],
        sampling_params: dict[str, Any],
    ) -> None:
        self.engine, self.store, self.req, self.model = engine, store, req, model
        self.messages, self.input_ids, self.sampling_params = messages, input_ids, sampling_params
        self.id = req.request_id or f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.item_id = f"msg_{uuid.uuid4().hex}"

    @classmethod
    def prepare(
        cls, engine: Engine, store: ResponseStore, req: ResponsesRequest, model_name: str
    ) -> _Run:
        _refuse_unsupported(req)
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous, previous_messages = store.get(req.previous_response_id)
            history = previous_messages + _as_messages(previous["output"])
        # The new request's instructions replace the previous one's (OpenAI's rule): stored
        # messages hold the conversation without them.
        messages = history + _input_messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        input_ids = chat_input_ids(engine, system + messages, req.chat_template_kwargs)
        room = engine.context_len - len(input_ids)
        if room < 1:
            raise BadRequest(
                f"the conversation is {len(input_ids)} tokens, which leaves no room for output "
                f"in the context length {engine.context_len}; shorten the input"
            )
        params: dict[str, Any] = {
            "max_new_tokens": min(req.max_output_tokens or room, room),
            "temperature": DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
            "top_p": DEFAULT_TOP_P if req.top_p is None else req.top_p,
            "frequency_penalty": req.frequency_penalty,
            "presence_penalty": req.presence_penalty,
        }
        for key in ("stop", "top_k", "min_p", "repetition_penalty"):
            if getattr(req, key) is not None:
                params[key] = getattr(req, key)
        return cls(engine, store, req, req.model or model_name, messages, input_ids, params)

    def generate(self, stream: bool = False):
        # The response id is the engine's rid, as in SGLang: /abort_request with it stops it.
        return self.engine.async_generate(
            input_ids=self.input_ids,
            sampling_params=self.sampling_params,
            rid=self.id,
            stream=stream,
        )

    async def answer(self, request: Request) -> Any:
        out = await unless_disconnected(request, self.generate())
        if out is None:  # the client went away: its request was aborted
            return Response(status_code=499)
        return self.finish(out)

    def start_background(self) -> dict:
        response = self.response("queued")
        self.store.put(response, self.messages)
        task = asyncio.create_task(self._background(response))
        self.store.tasks[self.id] = task
        task.add_done_callback(lambda _: self.store.tasks.pop(self.id, None))
        return dict(response)  # as it is now: the run updates the stored one

    async def _background(self, stored: dict) -> None:
        stored["status"] = "in_progress"
        try:
            out = await self.generate()
        except Exception as e:  # nobody waits on it: the stored response says what happened
            if stored["status"] != "cancelled":
                stored.update(status="failed", error={"code": "server_error", "message": str(e)})
            return
        if stored["status"] != "cancelled":
            self.finish(out)

    async def stream_events(self) -> AsyncIterator[str]:
        stream = await self.generate(stream=True)  # a refusal is still a plain 400 here
        return self._events(stream)

    async def _events(self, stream: AsyncIterator[dict]) -> AsyncIterator[str]:
        """OpenAI's event sequence for one message (SGLang's event types and fields), each
        `event: <type>` with its JSON, numbered by sequence_number from 0; no [DONE]."""
        numbers = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            data = {"type": kind, "sequence_number": next(numbers), **fields}
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        started = self.response("in_progress")
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        text, out, opened = "", None, False
        try:
            async for out in stream:
                delta = (out["text"] or "")[len(text) :]
                text = out["text"] or ""
                if not delta:
                    continue
                if not opened:
                    opened = True
                    item = _message(self.item_id, None, "in_progress")
                    yield event("response.output_item.added", output_index=0, item=item)
                    yield event("response.content_part.added", **where, part=_text_part(""))
                yield event("response.output_text.delta", **where, delta=delta, logprobs=[])
        except Exception as e:  # the status line is sent already: report in-band
            yield event("error", code="server_error", message=str(e), param=None)
            return
        if opened:
            yield event("response.output_text.done", **where, text=text, logprobs=[])
            yield event("response.content_part.done", **where, part=_text_part(text))
            item = _message(self.item_id, text)
            yield event("response.output_item.done", output_index=0, item=item)
        # SGLang ends every stream so (the openai client's get_final_response() waits for it).
        yield event("response.completed", response=self.finish(out))

    def finish(self, out: dict) -> dict:
        """The finished response from the engine's output, stored when the request asks."""
        meta = out["meta_info"]
        # SGLang's status is "completed" at a stop and at max_output_tokens alike (its own test
        # asserts incomplete_details null); an aborted request says so.
        aborted = (meta["finish_reason"] or {}).get("type") == "abort"
        status = "cancelled" if aborted else "completed"
        text = out["text"] or ""
        output = [_message(self.item_id, text)] if text else []
        prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
            # The chat names too: SGLang's releases differ in which shape they return, and its
            # own server test reads usage.prompt_tokens.
            "prompt_tokens": prompt,
            "completion_tokens": completion,
        }
        response = self.response(status, output, usage)
        if self.req.store or self.req.background:
            self.store.put(response, self.messages)
        return response

    def response(
        self, status: str, output: Optional[list] = None, usage: Optional[dict] = None
    ) -> dict:
        """SGLang's ResponsesResponse.from_request."""
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "output": output or [],
            "status": status,
            "usage": usage,
            "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": req.tool_choice,
            "tools": [],
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning and req.reasoning.effort, "summary": None},
            "store": req.store,
            "temperature": req.temperature,
            "text": req.text or ({"format": {"type": "text"}} if output else None),
            "top_p": req.top_p,
            "truncation": req.truncation,
            "user": req.user,
            "metadata": req.metadata or {},
        }


def _refuse_unsupported(req: ResponsesRequest) -> None:
    for key, (neutral, why) in _NEUTRAL.items():
        value = getattr(req, key)
        if value not in (neutral, None) and value != []:
            raise BadRequest(f"{key}: {why} (got {value!r:.80}; leave it out)")
    if req.tools:
        raise BadRequest("tools: specrl parses no tool calls; leave tools empty")
    if req.tool_choice not in ("auto", "none"):
        raise BadRequest(
            f"tool_choice {req.tool_choice!r:.80}: specrl parses no tool calls; use 'auto'"
        )
    text_format = (req.text or {}).get("format", {"type": "text"})
    if text_format.get("type") != "text":
        raise BadRequest(
            f"text.format {text_format.get('type')!r}: constrained output is not served by "
            "/v1/responses; leave text.format out (plain text)"
        )
    if req.truncation == "auto":
        raise BadRequest(
            "truncation 'auto': specrl does not drop earlier turns to fit the context; use "
            "'disabled' (the default)"
        )


def _input_messages(value: Any) -> list[dict]:
    """The input as chat messages: a string is one user message; a list holds messages (OpenAI's
    EasyInputMessage or message items) with text content."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind != "message":
            raise BadRequest(
                f"input[{i}] is a {kind!r} item; specrl parses no tool calls or reasoning "
                "items, send messages"
            )
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise BadRequest(
                f"input[{i}].role {role!r:.40} is not one of user, assistant, system, developer"
            )
        # OpenAI's developer role is what chat templates call system.
        messages.append({"role": "system" if role == "developer" else role, "content": ""})
        messages[-1]["content"] = _content_text(item.get("content"), i)
    return messages


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"input[{i}].content must be a string or a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(
                f"input[{i}].content has a {kind!r} part; specrl serves text-only models, send "
                "input_text parts"
            )
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _as_messages(output: list[dict]) -> list[dict]:
    """A stored response's output as the assistant turn that continues its conversation."""
    text = "".join(part["text"] for item in output for part in item["content"] if part.get("text"))
    return [{"role": "assistant", "content": text}] if text else []


def _message(item_id: str, text: Optional[str], status: str = "completed") -> dict:
    """An output message item: one text part, or none while it is being streamed."""
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [_text_part(text)],
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
