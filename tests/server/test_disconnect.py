"""A client that drops its connection aborts its request within a second, on every generating
endpoint (native and OpenAI, streaming or not, one prompt, a batch, n > 1): the engine's own
counters show it running when the client left, then no request left and every KV slot free or
cached as before, and the server serves the next request. The requests ask for tens of
thousands of tokens: they cannot finish by themselves during the test.

One real uvicorn server (in a thread, over TCP) serves every case, behind an API key: an
@app.middleware("http") (Starlette's BaseHTTPMiddleware) hides the disconnect from the
handlers, so a regression there fails these tests."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

from spec_engine import Engine

KEY = "sekret"
CONTEXT = 2**15
LONG = 30_000  # new tokens: minutes of decoding for the tiny model on a CPU
PROMPT = [5, 6, 7]
SAMPLING = {"max_new_tokens": LONG, "ignore_eos": True}
OPENAI = {"model": "m", "max_tokens": LONG, "ignore_eos": True}
CHAT = {**OPENAI, "messages": [{"role": "user", "content": "hello"}]}
# case: (path, body, the engine requests it runs)
CASES = {
    "generate": ("/generate", {"input_ids": PROMPT, "sampling_params": SAMPLING}, 1),
    "generate-batch": (
        "/generate",
        {"input_ids": [PROMPT, [8, 9, 10, 11]], "sampling_params": SAMPLING},
        2,
    ),
    "generate-n2": ("/generate", {"input_ids": PROMPT, "sampling_params": {**SAMPLING, "n": 2}}, 2),
    "generate-stream": (
        "/generate",
        {"input_ids": PROMPT, "sampling_params": SAMPLING, "stream": True},
        1,
    ),
    "completions": ("/v1/completions", {**OPENAI, "prompt": PROMPT}, 1),
    "completions-stream": ("/v1/completions", {**OPENAI, "prompt": PROMPT, "stream": True}, 1),
    "chat": ("/v1/chat/completions", CHAT, 1),
    "chat-stream": ("/v1/chat/completions", {**CHAT, "stream": True}, 1),
}


@pytest.fixture(scope="module")
def served(make_model):
    """(engine, port): an API-key server over an engine with room for the long requests."""
    import uvicorn

    from spec_engine.server.http_server import create_app

    path = make_model("llama", max_position_embeddings=CONTEXT)
    engine = Engine(model_path=path, random_seed=0, max_total_tokens=2 * CONTEXT, api_key=KEY)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(engine), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield engine, listener.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=30)
    engine.shutdown()


@pytest.fixture
def server(served):
    """The shared server; whatever a failed case left running is aborted after it, so that the
    next case starts idle."""
    yield served
    engine = served[0]
    engine.abort_request(abort_all=True)
    while _counters(engine)["num_running_reqs"] + _counters(engine)["num_waiting_reqs"]:
        time.sleep(0.02)


def _counters(engine: Engine) -> dict:
    """The scheduler's own counters, read on its thread (get_server_info's internal state)."""
    return engine.get_server_info()["internal_states"][0]


def _post(port: int, path: str, body: dict) -> socket.socket:
    """Send a POST on a raw socket (its answer left unread) and return the socket."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.parametrize("case", CASES)
def test_a_dropped_client_aborts_its_requests(server, case, caplog):
    import httpx

    engine, port = server
    path, body, count = CASES[case]
    caplog.set_level(logging.INFO, logger="spec_engine.server.requests")
    idle = engine.scheduler.memory_report()  # nothing runs: its thread leaves it alone
    assert idle["owned_by_requests"] == 0
    sock = _post(port, path, body)
    start = time.monotonic()
    while _counters(engine)["num_running_reqs"] < count:
        assert time.monotonic() - start < 30, f"{case}: its requests never started running"
        time.sleep(0.02)
    time.sleep(0.3)  # a few decode steps: the handler is waiting on the engine
    running = _counters(engine)
    assert running["num_running_reqs"] == count and running["num_used_tokens"] > 0, running
    with caplog.at_level(logging.INFO, logger="spec_engine.core.channel"):
        sock.close()
        dropped = time.monotonic()
        while (now := _counters(engine))["num_running_reqs"] + now["num_waiting_reqs"]:
            assert time.monotonic() - dropped < 1.0, f"{case}: still running 1 s after: {now}"
            time.sleep(0.02)
    assert now["num_used_tokens"] == 0, now
    report = engine.scheduler.memory_report()
    assert report["owned_by_requests"] == 0
    assert report["free"] + report["cached"] == idle["free"] + idle["cached"], (idle, report)
    aborted = [r for r in caplog.records if "aborted: its caller stopped waiting" in r.message]
    assert len(aborted) == count, [r.message for r in caplog.records]
    if not body.get("stream"):  # SGLang's line, which its test_abort.py searches for "Abort"
        sglang_line = "Request is disconnected from the client side. Abort request: POST " + path
        assert [r.message for r in caplog.records].count(sglang_line) == 1, caplog.records
    r = httpx.post(
        f"http://127.0.0.1:{port}/generate",
        json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
