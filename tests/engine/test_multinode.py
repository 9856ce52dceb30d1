"""Multi-node engines on the CPU, two "nodes" on one host (SGLang's --nnodes / --node-rank /
--dist-init-addr): node 1 is `python -m spec_engine.launch_server --node-rank 1` in a process of
its own, node 0 the in-process Engine holding rank 0; at --tp-size 2 --nnodes 2 (one rank each)
greedy decoding equals tp 1, node 1 exits once node 0's engine shuts down, and what cannot run
over nodes is refused by name before any rank starts."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from spec_engine import Engine
from spec_engine.distributed.launch import RankFailed
from tests.support.forkserver import Session, python_c

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
# --dist-timeout: a node that never joins fails the test in a minute instead of hanging it.
ENGINE = dict(
    skip_tokenizer_init=True,
    max_total_tokens=512,
    device="cpu",
    log_level="warning",
    dist_timeout=60,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_node_1(path: str, addr: str, log: str) -> Session:
    """Node 1 of --tp-size 2 --nnodes 2 (its one rank), as SGLang's docs start it: a process of
    its own, forked from tests/support/forkserver.py's server (no seconds of imports)."""
    argv = ["--model-path", path, "--tp-size", "2", "--nnodes", "2", "--node-rank", "1"]
    argv += ["--dist-init-addr", addr, "--device", "cpu", "--skip-tokenizer-init"]
    argv += ["--max-total-tokens", "512", "--log-level", "warning", "--dist-timeout", "60"]
    return Session("spec_engine.launch_server", argv, log, log)


def _end(node: Session) -> None:
    if node.poll() is None:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(10)


def test_two_nodes_decode_as_one_rank_and_node_1_exits_with_the_engine(llama_path, tmp_path):
    addr, log = f"127.0.0.1:{_free_port()}", str(tmp_path / "node1.log")
    node1 = _launch_node_1(llama_path, addr, log)
    try:
        with Engine(model_path=llama_path, tp_size=1, **ENGINE) as engine:
            one = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        with Engine(
            model_path=llama_path, tp_size=2, nnodes=2, dist_init_addr=addr, **ENGINE
        ) as engine:
            info = engine.get_server_info()
            two = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert node1.poll() is None  # node 1 serves as long as the engine runs
        node1.wait(30)
    finally:
        _end(node1)
    assert (info["tp_size"], info["nnodes"], info["node_rank"]) == (2, 2, 0)
    assert info["dist_init_addr"] == addr
    assert [o["output_ids"] for o in two] == [o["output_ids"] for o in one]
    assert node1.returncode == 0, open(log).read()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(nnodes=2), "--nnodes 2 needs --dist-init-addr HOST:PORT"),
        (dict(nnodes=2, dist_init_addr="node0"), "--dist-init-addr must be HOST:PORT, got 'node0'"),
        (
            dict(tp_size=3, nnodes=2, dist_init_addr="n:1"),
            "--tp-size 3 is not divisible by --nnodes 2",
        ),
        (
            dict(nnodes=2, node_rank=2, dist_init_addr="n:1"),
            r"--node-rank must be in 0\.\.1 .*got 2",
        ),
        (
            dict(nnodes=2, node_rank=1, dist_init_addr="n:1"),
            "--node-rank 1: .*launch_server --node-rank 1",
        ),
    ],
)
def test_what_nodes_cannot_run_is_refused_by_name(kwargs, match, llama_path):
    with pytest.raises(ValueError, match=match):
        Engine(model_path=llama_path, **dict(ENGINE, tp_size=2) | kwargs)


def test_a_node_that_never_joins_is_named(llama_path):
    addr = f"127.0.0.1:{_free_port()}"
    with pytest.raises(RankFailed, match=r"rank 1 \(node 1\) did not join within --dist-timeout"):
        Engine(
            model_path=llama_path,
            **dict(ENGINE, tp_size=2, dist_timeout=1),
            nnodes=2,
            dist_init_addr=addr,
        )


# Node 0's rank 0 builds its engine, then its process dies without stopping the engine.
_DYING_NODE_0 = """
import os, sys
from spec_engine import Engine
Engine(model_path=sys.argv[1], tp_size=2, nnodes=2, dist_init_addr=sys.argv[2],
       skip_tokenizer_init=True, max_total_tokens=512, device="cpu", dist_timeout=60)
os._exit(3)
"""


def test_node_1_fails_by_name_when_rank_0_dies(llama_path, tmp_path):
    addr, log = f"127.0.0.1:{_free_port()}", str(tmp_path / "node1.log")
    node1 = _launch_node_1(llama_path, addr, log)
    try:
        node0 = python_c(_DYING_NODE_0, [llama_path, addr], timeout=60)
        assert node0.returncode == 3, node0.stderr
        node1.wait(30)
    finally:
        _end(node1)
    assert node1.returncode != 0
    assert "node 1: tensor-parallel rank 0 is gone" in open(log).read()


def test_a_rank_dying_on_node_1_fails_node_0s_requests_by_name(llama_path, tmp_path):
    """Node 1's process killed mid-generation: node 0's request in flight fails within seconds
    with an error naming rank 1 and its node (node 1's heartbeat through the store stopped), the
    engine stops, and /health says so."""
    from fastapi.testclient import TestClient

    from spec_engine.server.http_server import create_app

    addr, log = f"127.0.0.1:{_free_port()}", str(tmp_path / "node1.log")
    node1 = _launch_node_1(llama_path, addr, log)
    try:
        engine = Engine(model_path=llama_path, tp_size=2, nnodes=2, dist_init_addr=addr, **ENGINE)
        try:
            client = TestClient(create_app(engine))
            assert client.get("/health").status_code == 200
            done: dict[str, object] = {}
            started = threading.Event()

            def generate() -> None:
                params = {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}
                try:
                    for _ in engine.generate(
                        input_ids=[5, 6, 7], sampling_params=params, stream=True
                    ):
                        started.set()
                except Exception as e:
                    done["error"] = str(e)
                done["at"] = time.monotonic()

            thread = threading.Thread(target=generate, daemon=True)
            thread.start()
            assert started.wait(30)
            killed = time.monotonic()
            os.killpg(node1.pid, signal.SIGKILL)
            thread.join(15)
            assert "at" in done and "error" in done, "the request outlived the kill (or hung)"
            assert done["at"] - killed < 8
            assert "tensor-parallel rank 1 (node 1)" in done["error"], done["error"]
            health = client.get("/health")
            assert health.status_code == 503 and "rank 1 (node 1)" in health.text
        finally:
            engine.shutdown()
    finally:
        _end(node1)
