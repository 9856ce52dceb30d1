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
            engine.async_generate(input_ids=[[5, 6, 7], [9, 10]], sampling_params=params),
        )
        chunks = [
            c
            async for c in await engine.async_generate(
                input_ids=[9, 10], sampling_params=params, stream=True
            )
        ]
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
    outs = engine.generate(
        input_ids=[[5, 6], [7, 8]],
        rid=["a", "b"],
        sampling_params=[{"n": 2, "max_new_tokens": 3}, {"n": 3, "max_new_tokens": 3}],
    )
    assert [o["meta_info"]["id"] for o in outs] == ["a-0", "a-1", "b-0", "b-1", "b-2"]
    one = engine.generate(input_ids=[5, 6], rid="solo", sampling_params={"max_new_tokens": 2})
    assert one["meta_info"]["id"] == "solo"
    with pytest.raises(ValueError, match="rid"):
        engine.generate(input_ids=[[5], [6]], rid="just-one")


def test_server_and_model_info(engine, llama_path):
    info = engine.get_server_info()
    assert (
        info["model_path"] == llama_path and info["device"] == "cpu" and info["dtype"] == "float32"
    )
    assert info["max_total_num_tokens"] > 0 and info["weight_version"] == "default"
    assert engine.get_model_info()["architecture"] == "LlamaForCausalLM"


def test_shutdown_refuses_new_work(llama_path):
    e = Engine(model_path=llama_path, random_seed=0)
    e.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate(input_ids=[5, 6])


def test_a_caller_whose_event_loop_closed_does_not_stop_the_engine(engine):
    async def impatient():
        await asyncio.wait_for(
            engine.async_generate(
                input_ids=[5, 6, 7],
                stream=False,
                sampling_params={"max_new_tokens": 200, "ignore_eos": True},
            ),
            timeout=0.05,
        )

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(impatient())

    async def streaming_then_gone():
        stream = await engine.async_generate(
            input_ids=[5, 6, 7],
            stream=True,
            sampling_params={"max_new_tokens": 200, "ignore_eos": True},
        )
        async for _ in stream:
            break

    asyncio.run(streaming_then_gone())
    assert (
        engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 3})["meta_info"][
            "completion_tokens"
        ]
        == 3
    )
    assert engine._thread.is_alive()


@pytest.mark.parametrize("where", ["forward", "bookkeeping after prefill"])
def test_a_failing_step_fails_its_requests_and_the_engine_recovers(engine, where):
    owner = engine.scheduler.worker if where == "forward" else engine.scheduler.kv.tree_cache
    name = "prefill" if where == "forward" else "cache_unfinished_req"

    def broken(*args, **kwargs):
        raise RuntimeError(f"injected failure in {where}")

    setattr(owner, name, broken)
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            engine.generate(
                input_ids=[[5, 6, 7], [8, 9], [10, 11, 12]], sampling_params={"max_new_tokens": 4}
            )
    finally:
        delattr(owner, name)
    assert (
        len(
            engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})[
                "output_ids"
            ]
        )
        == 4
    )
    report = engine.scheduler.memory_report()
    assert report["owned_by_requests"] == 0 and report["free"] + report["cached"] == report["total"]


def test_top_logprobs_are_per_request(engine):
    outs = engine.generate(
        input_ids=[[5, 6, 7], [8, 9]],
        return_logprob=True,
        top_logprobs_num=3,
        sampling_params={"max_new_tokens": 3},
    )
    assert all(len(top) == 3 for o in outs for top in o["meta_info"]["output_top_logprobs"])
    few = engine.generate(
        input_ids=[5, 6, 7],
        return_logprob=True,
        top_logprobs_num=1,
        sampling_params={"max_new_tokens": 3, "temperature": 0},
    )
    assert all(len(top) == 1 for top in few["meta_info"]["output_top_logprobs"])
    none = engine.generate(
        input_ids=[5, 6, 7], top_logprobs_num=4, sampling_params={"max_new_tokens": 2}
    )
    assert (
        "output_top_logprobs" not in none["meta_info"]
        and "output_token_logprobs" not in none["meta_info"]
    )
    # The top entry is the largest log-prob, and greedy picks it.
    first = few["meta_info"]["output_top_logprobs"][0][0]
    assert (
        first[1] == few["output_ids"][0]
        and abs(first[0] - few["meta_info"]["output_token_logprobs"][0][0]) < 1e-6
    )


def test_unset_max_new_tokens_fills_what_fits(make_model):
    path = make_model("llama", max_position_embeddings=256)
    with Engine(model_path=path, random_seed=0, max_total_tokens=100) as small:
        out = small.generate(
            input_ids=[5] * 30, sampling_params={"max_new_tokens": None, "ignore_eos": True}
        )
    assert out["meta_info"]["completion_tokens"] == 70
