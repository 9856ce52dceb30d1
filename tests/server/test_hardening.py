"""Hostile input that must not corrupt a running engine: non-finite weight updates are refused
naming the tensor and leave the weights bitwise as they were; NaN logits are caught by
--enable-nan-detection."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spec_engine import Engine

NAME = "model.layers.0.mlp.down_proj.weight"
REQUEST = dict(input_ids=[5, 6, 7, 8], sampling_params={"temperature": 0, "max_new_tokens": 6})


@pytest.fixture(scope="module")
def path(make_model) -> str:
    return make_model("llama", max_position_embeddings=256)


def test_non_finite_weight_updates_are_refused(path, tmp_path):
    with Engine(model_path=path, random_seed=0, max_total_tokens=1024) as engine:
        before = engine.get_weights_checksum()
        greedy = engine.generate(**REQUEST)["output_ids"]
        good = load_file(f"{path}/model.safetensors")
        for bad_value in (float("nan"), float("inf")):
            tensors = {k: v.clone() for k, v in good.items()}
            tensors[NAME][3, 1] = bad_value
            with pytest.raises(ValueError, match=f"weight '{NAME}' has non-finite values"):
                engine.update_weights_from_tensor(list(tensors.items()))
        bad_dir = tmp_path / "bad"
        shutil.copytree(path, bad_dir)
        save_file(tensors, str(bad_dir / "model.safetensors"))
        with pytest.raises(ValueError, match="non-finite values"):
            engine.update_weights_from_disk(str(bad_dir))
        assert engine.get_weights_checksum() == before
        assert engine.generate(**REQUEST)["output_ids"] == greedy


def test_nan_detection_keeps_sampling(path, caplog):
    """--enable-nan-detection: NaN logits (here: a NaN weight row in the LM head) are logged,
    and the request still gets valid tokens."""
    with Engine(
        model_path=path, random_seed=0, max_total_tokens=1024, enable_nan_detection=True
    ) as engine:
        head = engine.runner.model.lm_head.weight
        with torch.no_grad():
            head.data[7].fill_(float("nan"))
        engine.runner.model.lm_head.refresh_derived()
        with caplog.at_level(logging.WARNING, logger="spec_engine.core.logits_processor"):
            out = engine.generate(**REQUEST, return_logprob=True)
        assert len(out["output_ids"]) == 6 and 7 not in out["output_ids"]
        assert "NaN in the logits" in caplog.text


def start_server(path: str, *flags: str):
    """A server process on a free port; returns (url, process)."""
    import socket
    import subprocess
    import sys
    import time

    httpx = pytest.importorskip("httpx")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spec_engine.launch_server",
            "--model-path",
            path,
            "--port",
            str(port),
            "--max-total-tokens",
            "2048",
            "--log-level",
            "warning",
            *flags,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    return url, proc


@pytest.fixture(scope="module")
def server(path):
    url, proc = start_server(path, "--max-request-bytes", "100000")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_tokenizing_a_huge_prompt_blocks_nothing(make_model):
    """A 1 MB prompt takes seconds to tokenize: meanwhile /health answers within 100 ms and
    another request completes; then the prompt is refused (it cannot fit the KV cache)."""
    import threading
    import time

    import httpx

    url, proc = start_server(make_model("llama", max_position_embeddings=2**17))
    try:
        result = {}
        thread = threading.Thread(
            target=lambda: result.update(
                r=httpx.post(
                    url + "/generate", json={"text": "hello world " * 120_000}, timeout=120
                )
            )
        )
        start = time.perf_counter()
        thread.start()
        time.sleep(0.3)
        latencies = []
        client = httpx.Client()  # one client: creating one per call costs ~0.1 s by itself
        while thread.is_alive() and len(latencies) < 5:
            t = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.perf_counter() - t)
            time.sleep(0.05)
        small = client.post(
            url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}}
        )
        assert small.status_code == 200 and thread.is_alive(), (
            "the big prompt was too quick to tell"
        )
        thread.join()
        latencies.sort()
        # The median is the claim; the worst case leaves room for a loaded 2-core CI machine.
        assert latencies[len(latencies) // 2] < 0.1 and latencies[-1] < 0.3, latencies
        message = result["r"].json()["error"]["message"]
        assert result["r"].status_code == 400 and "does not fit the context length" in message
        # Refused by its token count before the ids became Python ints (converting them holds
        # the GIL), not by the request check after it, whose message adds the KV cache size.
        assert message.endswith(f"context length {2**17}; shorten it"), message
        assert time.perf_counter() - start > 0.5
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_body_limit_and_huge_prompts_are_refused_quickly(server):
    import time

    import httpx

    big = {"text": "x" * 200_000}
    r = httpx.post(server + "/generate", json=big)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    start = time.perf_counter()
    r = httpx.post(server + "/generate", json={"text": "ab " * 30_000})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    # Refused by its length in characters, before it was tokenized at all.
    assert "the prompt has 90000 characters" in r.json()["error"]["message"]
    assert time.perf_counter() - start < 2
    r = httpx.post(server + "/generate", json={"input_ids": [5, 6], "rid": "dup"})
    assert r.status_code == 200
    assert httpx.get(server + "/health").status_code == 200


def test_a_rid_in_flight_cannot_be_reused(path):
    with Engine(model_path=path, random_seed=0, max_total_tokens=1024) as engine:
        stream = engine.generate(
            input_ids=[5, 6], sampling_params={"max_new_tokens": 50}, rid="a", stream=True
        )
        next(stream)
        with pytest.raises(ValueError, match="Duplicate request ID detected: a "):
            engine.generate(input_ids=[5, 6], rid="a")
        list(stream)
        assert engine.generate(input_ids=[5, 6], rid="a", sampling_params={"max_new_tokens": 2})


def test_request_caps_and_malformed_text(path, server):
    import httpx

    with Engine(
        model_path=path,
        random_seed=0,
        max_total_tokens=1024,
        max_request_prompts=2,
        max_request_samples=4,
        max_request_tokens=100,
    ) as engine:
        for kwargs, flag in (
            (dict(input_ids=[[5]] * 3), "--max-request-prompts"),
            (
                dict(input_ids=[5], sampling_params={"n": 5, "max_new_tokens": 2}),
                "--max-request-samples",
            ),
            (
                dict(input_ids=[5] * 10, sampling_params={"n": 4, "max_new_tokens": 20}),
                "--max-request-tokens",
            ),
        ):
            with pytest.raises(ValueError, match=f"above the server's limit .*{flag}"):
                engine.generate(**kwargs)
        assert engine.generate(input_ids=[[5], [6]], sampling_params={"max_new_tokens": 2})
    r = httpx.post(
        server + "/generate",
        content=b'{"text": "\\ud800 hi"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"]
    r = httpx.post(
        server + "/generate",
        content=b"[" * 50_000 + b"]" * 50_000,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert httpx.get(server + "/health_generate").status_code == 200


POISON = 9  # a token whose embedding row is set to NaN: only prompts holding it go wrong


@pytest.mark.parametrize(
    "spec", [{}, {"speculative_algorithm": "NGRAM"}], ids=["plain", "ngram-verify"]
)
def test_nan_logits_fail_only_their_request_with_a_500(path, spec):
    """Without --enable-nan-detection, a request whose logits turn NaN (here: a NaN embedding
    row for a token only its prompt holds) fails with a 500 naming the cause, whether or not it
    asked for log-probs, on the plain and the speculative (verify) path; a request batched with
    it gets exactly its solo output, and every KV slot is returned."""
    import asyncio

    from fastapi.testclient import TestClient

    from spec_engine.core.outputs import EngineFailure
    from spec_engine.server.http_server import create_app

    healthy = dict(input_ids=[5, 6, 7, 8], sampling_params={"temperature": 0, "max_new_tokens": 8})
    poisoned = dict(healthy, input_ids=[5, POISON, 7, 8])
    with Engine(model_path=path, random_seed=0, max_total_tokens=1024, **spec) as engine:
        solo = engine.generate(**healthy)["output_ids"]
        with torch.no_grad():
            engine.runner.model.model.embed_tokens.weight.data[POISON].fill_(float("nan"))

        async def both():
            return await asyncio.gather(
                engine.async_generate(**healthy),
                engine.async_generate(**poisoned),
                return_exceptions=True,
            )

        good, bad = asyncio.run(both())
        assert good["output_ids"] == solo
        assert isinstance(bad, EngineFailure) and "NaN/Inf logits" in str(bad)
        client = TestClient(create_app(engine))
        for logprob in (False, True):
            r = client.post("/generate", json={**poisoned, "return_logprob": logprob})
            assert r.status_code == 500 and "NaN/Inf logits" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200
        engine.flush_cache()
        report = engine.scheduler.memory_report()
        assert report["free"] == report["total"]
