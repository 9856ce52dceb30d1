"""SGLang's control and introspection endpoints beyond /generate: server info, loads, weight
versions, tokenize/detokenize, metrics, weights by name (slime's engine client calls these).
The weight-update and memory endpoints are http_server's CONTROL_METHODS."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from spec_engine.engine import Engine
from spec_engine.server.requests import BadRequest, json_body

# What SGLang's /v1/loads?include= takes; everything specrl has is in "core" and "queues".
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def add_admin_routes(app: FastAPI, engine: Engine) -> None:
    """Register the endpoints on `app` (see the module docstring)."""

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict:
        return await asyncio.to_thread(engine.get_server_info)

    @app.get("/get_load")
    @app.get("/v1/loads")
    async def loads(request: Request) -> dict:
        include = request.query_params.get("include", "all")
        unknown = [s for s in include.split(",") if s and s not in LOAD_SECTIONS]
        if unknown:
            sections = ", ".join(LOAD_SECTIONS)
            raise BadRequest(f"unknown include section(s) {unknown}; use {sections}")
        return await asyncio.to_thread(engine.get_load)

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict:
        return {"weight_version": engine.get_weight_version()}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict:
        body = await json_body(request)
        _only(body, ("new_version", "abort_all_requests"))
        version = body.get("new_version")
        abort = body.get("abort_all_requests", False)
        if not isinstance(abort, bool):
            raise BadRequest(f"abort_all_requests must be true or false, got {abort!r}")
        await asyncio.to_thread(engine.update_weight_version, version, abort)
        return {"success": True, "message": f"weight version is {version}"}

    @app.post("/get_weights_by_name")
    async def get_weights_by_name(request: Request) -> list:
        body = await json_body(request)
        _only(body, ("name", "truncate_size"))
        name, size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str):
            raise BadRequest(f"name must be a weight name (a string), got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int):
            raise BadRequest(f"truncate_size must be an integer, got {size!r}")
        return await asyncio.to_thread(engine.get_weights_by_name, name, size)

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await json_body(request)
        _only(body, ("model", "prompt", "add_special_tokens"))
        tokenizer = _tokenizer(engine)
        prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise BadRequest(f"add_special_tokens must be true or false, got {special!r}")
        single = isinstance(prompt, str)
        if not single and not (
            isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)
        ):
            raise BadRequest("prompt must be a string or a non-empty list of strings")
        prompts = [prompt] if single else prompt
        tokens = await asyncio.to_thread(
            lambda: [tokenizer(p, add_special_tokens=special)["input_ids"] for p in prompts]
        )
        return {
            "tokens": tokens[0] if single else tokens,
            "count": len(tokens[0]) if single else [len(t) for t in tokens],
            "max_model_len": engine.context_len,
        }

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await json_body(request)
        _only(body, ("model", "tokens"))
        tokenizer = _tokenizer(engine)
        tokens = body.get("tokens")
        vocab = engine.model_config.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise BadRequest(f"tokens must be a list of token ids in [0, {vocab})")
        return {"text": await asyncio.to_thread(tokenizer.decode, tokens)}

    registry = None
    if engine.args.enable_metrics:
        from spec_engine.server.metrics import make_registry

        registry = make_registry(engine)

    @app.get("/metrics")
    async def metrics() -> Response:
        if registry is None:
            return JSONResponse(
                {"error": {"message": "metrics are off; start the server with --enable-metrics"}},
                status_code=404,
            )
        from spec_engine.server.metrics import metrics_text

        body, content_type = await asyncio.to_thread(metrics_text, registry)
        return Response(body, media_type=content_type)


def _only(body: dict[str, Any], keys: tuple[str, ...]) -> None:
    unknown = set(body) - set(keys)
    if unknown:
        raise BadRequest(f"unknown field(s) {sorted(unknown)}; allowed: {list(keys)}")


def _tokenizer(engine: Engine) -> Any:
    if engine.tokenizer is None:
        raise BadRequest("the server runs with --skip-tokenizer-init: it has no tokenizer")
    return engine.tokenizer
