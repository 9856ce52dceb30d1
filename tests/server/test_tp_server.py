"""`launch_server --tensor-parallel-size 2` (SGLang's flag) starts its second rank itself,
reports tp_size in /get_server_info and serves /generate as the engine at tp 1 does."""

from __future__ import annotations

import pytest

from spec_engine import Engine
from trainer_bridge.megatron_compat import free_port

httpx = pytest.importorskip("httpx")

from tests.support.server_process import served  # noqa: E402 (needs httpx)


def test_a_server_at_tp_size_2_serves_as_tp_1(make_model):
    path = make_model("qwen2", tie_word_embeddings=True)
    flags = ["--model-path", path, "--tensor-parallel-size", "2", "--max-total-tokens", "512"]
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    with served(flags + ["--debug-tp-check-tokens", "--log-level", "warning"], free_port()) as url:
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": params}
        out = httpx.post(url + "/generate", json=body, timeout=60).json()
    assert info["tp_size"] == 2
    with Engine(model_path=path, max_total_tokens=512, skip_tokenizer_init=True) as engine:
        local = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=params)
    assert out["output_ids"] == local["output_ids"]
