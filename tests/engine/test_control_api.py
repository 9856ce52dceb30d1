"""The engine's control API is written once (spec_engine.control_methods): every wrapper takes
exactly the engine method's parameters, under the same names, with the same defaults."""

from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from rollout.engine_actor import EngineActor, RayEngineHandle
from spec_engine import Engine
from spec_engine.control_methods import CONTROL_METHODS, add_control_methods
from spec_engine.server.http_server import create_app

NAMES = [m.name for m in CONTROL_METHODS]


@pytest.mark.parametrize("wrapper", [EngineActor, RayEngineHandle])
@pytest.mark.parametrize("name", NAMES)
def test_ray_wrappers_take_the_engines_parameters(wrapper, name):
    assert inspect.signature(getattr(wrapper, name)) == inspect.signature(getattr(Engine, name))
    assert inspect.iscoroutinefunction(getattr(wrapper, name))


@pytest.fixture(scope="module")
def http():
    # The routes are built from the engine's methods: an Engine that never started serves to
    # read their fields (each request below is refused before it reaches the engine).
    engine = Engine.__new__(Engine)
    engine.args = SimpleNamespace(
        api_key=None, max_request_bytes=2**20, served_model_name="m", enable_metrics=False
    )
    return TestClient(create_app(engine))


@pytest.mark.parametrize("method", [m for m in CONTROL_METHODS if m.http], ids=lambda m: m.name)
def test_http_routes_take_the_engines_parameters(http, method):
    engine_params = list(inspect.signature(getattr(Engine, method.name)).parameters)[1:]
    expected = ["serialized_named_tensors" if p == "named_tensors" else p for p in engine_params]
    for verb in method.http:
        r = http.request(verb, f"/{method.name}", json={"no_such_field": 1})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        allowed = ast.literal_eval(message.split("allowed: ", 1)[1])
        assert list(dict.fromkeys(allowed)) == list(dict.fromkeys(expected))


def test_a_wrapper_that_restates_a_control_method_is_refused():
    class Restating:
        async def flush_cache(self) -> bool:
            return True

    with pytest.raises(TypeError, match="Restating.flush_cache restates"):
        add_control_methods(lambda *a: None)(Restating)
