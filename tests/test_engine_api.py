"""The Engine API surface: async generation, streaming, n samples, rids, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from spec_engine import Engine


@pytest.fixture(scope="module")
def engine(llama_path):
    with Engine(model_path=llama_path, random_seed=0) as e:
        yield e


def test_async_generate_matches_sync(engine):
    params = {"temperature": 0, "max_new_tokens": 10}
    sync = engine.generate(input_ids=[[5, 6, 7], [9, 10]], sampling_params=params)

    async def run():
        single, batch = await asyncio.gather(
            engine.async_generate(input_ids=[5, 6, 7], sampling_params=params),
            engine.async_generate(input_ids=[[5, 6, 7], [9, 10]], sampling_params=params))
        chunks = [c async for c in await engine.async_generate(input_ids=[9, 10], sampling_params=params, stream=True)]
        return single, batch, chunks

    single, batch, chunks = asyncio.run(run())
    assert single["output_ids"] == sync[0]["output_ids"]
    assert [o["output_ids"] for o in batch] == [o["output_ids"] for o in sync]
    assert chunks[-1]["output_ids"] == sync[1]["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_sync_stream_of_a_batch_carries_indices(engine):
    params = {"temperature": 0, "max_new_tokens": 6}
    final = engine.generate(prompt=["The cat", "A dog"], sampling_params=params)
    last = {}
    for chunk in engine.generate(prompt=["The cat", "A dog"], sampling_params=params, stream=True):
        last[chunk["index"]] = chunk
    assert [last[i]["output_ids"] for i in (0, 1)] == [o["output_ids"] for o in final]
    assert [last[i]["text"] for i in (0, 1)] == [o["text"] for o in final]


def test_n_samples_and_rids(engine):
    outs = engine.generate(input_ids=[[5, 6], [7, 8]], rid=["a", "b"],
                           sampling_params=[{"n": 2, "max_new_tokens": 3}, {"n": 3, "max_new_tokens": 3}])
    assert [o["meta_info"]["id"] for o in outs] == ["a-0", "a-1", "b-0", "b-1", "b-2"]
    one = engine.generate(input_ids=[5, 6], rid="solo", sampling_params={"max_new_tokens": 2})
    assert one["meta_info"]["id"] == "solo"
    with pytest.raises(ValueError, match="rid"):
        engine.generate(input_ids=[[5], [6]], rid="just-one")


def test_server_and_model_info(engine, llama_path):
    info = engine.get_server_info()
    assert info["model_path"] == llama_path and info["device"] == "cpu" and info["dtype"] == "float32"
    assert info["max_total_num_tokens"] > 0 and info["weight_version"] == "default"
    assert engine.get_model_info()["architecture"] == "LlamaForCausalLM"


def test_shutdown_refuses_new_work(llama_path):
    e = Engine(model_path=llama_path, random_seed=0)
    e.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate(input_ids=[5, 6])


def test_a_failing_step_fails_its_requests_and_the_engine_recovers(engine):
    worker = engine.scheduler.worker
    original = worker.prefill

    def broken(reqs):
        raise RuntimeError("injected failure")

    worker.prefill = broken
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 4})
    finally:
        worker.prefill = original
    assert len(engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})["output_ids"]) == 4
    report = engine.scheduler.memory_report()
    assert report["owned_by_requests"] == 0 and report["free"] + report["cached"] == report["total"]
