"""SGLang's control and introspection endpoints beyond /generate: server info, loads, weight
versions, tokenize/detokenize, metrics, profiling (slime's engine client calls these)."""

from __future__ import annotations

from fastapi import FastAPI

from spec_engine.engine import Engine


def add_admin_routes(app: FastAPI, engine: Engine) -> None:
    """Register the endpoints on `app` (see the module docstring)."""
