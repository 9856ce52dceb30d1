"""SGLang's control and introspection endpoints beyond /generate: server info, loads, weight
versions, tokenize/detokenize, metrics, weights by name (slime's engine client calls these).
The weight-update and memory endpoints are generated from control_methods.CONTROL_METHODS
(server.http_server)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from spec_engine.engine import Engine
from spec_engine.server.requests import BadRequest, json_body


def add_admin_routes(app: FastAPI, engine: Engine) -> None:
    """Register the endpoints on `app` (see the module docstring)."""
    _add_load_routes(app, engine)
    _add_weight_routes(app, engine)
    _add_token_routes(app, engine)
    _add_metrics_route(app, engine)


def _add_load_routes(app: FastAPI, engine: Engine) -> None:
    """Server info and loads, in SGLang's current and legacy shapes."""

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict:
        return await asyncio.to_thread(engine.get_server_info)

    @app.get("/v1/loads")
    async def loads(request: Request) -> Any:
        """SGLang's /v1/loads: ?include=core,queues,... (default all), ?dp_rank=0,
        ?format=json|prometheus."""
        query = request.query_params
        include = [s.strip() for s in query.get("include", "all").split(",") if s.strip()]
        if query.get("dp_rank", "0") != "0":
            raise BadRequest(f"dp_rank {query['dp_rank']!r}: this server is one rank, dp_rank 0")
        kind = query.get("format", "json")
        if kind not in ("json", "prometheus"):
            raise BadRequest(f"format must be json or prometheus, got {kind!r}")
        result = await asyncio.to_thread(engine.get_load, include)
        if kind == "prometheus":
            return Response(_loads_text(result["loads"]), media_type="text/plain; version=0.0.4")
        return result

    @app.get("/get_load")
    async def get_load() -> list:
        """SGLang's legacy load shape, one entry per data-parallel rank."""
        result = await asyncio.to_thread(engine.get_load, ["core"])
        tic = time.perf_counter()
        return [
            {
                "dp_rank": load["dp_rank"],
                "num_reqs": load["num_total_reqs"],
                "num_waiting_reqs": load["num_waiting_reqs"],
                "num_tokens": load["num_total_tokens"],
                "num_pending_tokens": load["num_total_tokens"] - load["num_used_tokens"],
                "ts_tic": tic,
            }
            for load in result["loads"]
        ]


def _add_weight_routes(app: FastAPI, engine: Engine) -> None:
    """The weight version (read, relabel) and weights by name."""

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict:
        return {"weight_version": engine.get_weight_version()}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict:
        body = await json_body(request)
        _only(body, ("new_version", "abort_all_requests"))
        abort = body.get("abort_all_requests", True)
        if not isinstance(abort, bool):
            raise BadRequest(f"abort_all_requests must be true or false, got {abort!r}")
        return await asyncio.to_thread(engine.update_weight_version, body.get("new_version"), abort)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> list:
        body = await json_body(request)
        _only(body, ("name", "truncate_size"))
        name, size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str):
            raise BadRequest(f"name must be a weight name (a string), got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int):
            raise BadRequest(f"truncate_size must be an integer, got {size!r}")
        return await asyncio.to_thread(engine.get_weights_by_name, name, size)


def _add_token_routes(app: FastAPI, engine: Engine) -> None:
    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await json_body(request)
        _only(body, ("model", "prompt", "add_special_tokens"))
        tokenizer = _tokenizer(engine)
        prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
        _check_bool("add_special_tokens", special)
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
        """{"tokens": ids or a list of id lists, "skip_special_tokens": true} -> {"text": text
        or a list of texts}."""
        body = await json_body(request)
        _only(body, ("model", "tokens", "skip_special_tokens"))
        tokenizer = _tokenizer(engine)
        tokens, skip = body.get("tokens"), body.get("skip_special_tokens", True)
        _check_bool("skip_special_tokens", skip)
        batch = isinstance(tokens, list) and bool(tokens) and isinstance(tokens[0], list)
        rows = tokens if batch else [tokens]
        vocab = engine.model_config.vocab_size
        bad = _bad_token(tokens, rows, vocab)
        if bad is not None:
            raise BadRequest(
                f"tokens must be a list of token ids in [0, {vocab}), or a list of such lists "
                f"(got {bad:.80})"
            )
        texts = await asyncio.to_thread(
            lambda: [tokenizer.decode(row, skip_special_tokens=skip) for row in rows]
        )
        return {"text": texts if batch else texts[0]}


def _bad_token(tokens: Any, rows: list, vocab: int) -> Optional[str]:
    """The first entry of /detokenize's `tokens` that is no token id (or the malformed value),
    as its repr; None when all are ids. (SGLang answers an id such as -1 with a 500: see
    docs/sglang_compat.md.)"""
    if not isinstance(tokens, list):
        return repr(tokens)
    for row in rows:
        if not isinstance(row, list):
            return repr(row)
        for t in row:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                return repr(t)
    return None


def _add_metrics_route(app: FastAPI, engine: Engine) -> None:
    """Prometheus metrics with --enable-metrics (a 404 that says so without)."""
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


def _loads_text(loads: list[dict[str, Any]]) -> str:
    """/v1/loads?format=prometheus: SGLang's gauges, sglang_<field> and sglang_<section>_<field>
    (spec and disagg for the speculative and disaggregation sections)."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        rank = load["dp_rank"]
        for key, value in load.items():
            if isinstance(value, dict):
                for sub, number in value.items():
                    if isinstance(number, (int, float)):
                        name = f"sglang_{prefixes.get(key, key)}_{sub}"
                        samples.setdefault(name, []).append((rank, number))
            elif isinstance(value, (int, float)) and key != "dp_rank":
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values]
    return "\n".join(lines) + "\n"


def _only(body: dict[str, Any], keys: tuple[str, ...]) -> None:
    unknown = set(body) - set(keys)
    if unknown:
        raise BadRequest(f"unknown field(s) {sorted(unknown)}; allowed: {list(keys)}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}")


def _tokenizer(engine: Engine) -> Any:
    if engine.tokenizer is None:
        raise BadRequest("the server runs with --skip-tokenizer-init: it has no tokenizer")
    return engine.tokenizer
