"""Bad input is refused in-process with a ValueError naming the field; the engine keeps serving."""

from __future__ import annotations

import pytest

from spec_engine import Engine

BAD_REQUESTS = [
    (dict(input_ids=[5, 6], sampling_params={"temperatur": 0.5}), "temperatur"),
    (dict(input_ids=[5, 6], sampling_params={"max_new_tokens": -3}), "max_new_tokens"),
    (dict(input_ids=[5, 6], sampling_params={"max_new_tokens": 1000}), "max_new_tokens"),
    (dict(input_ids=[5] * 300), "context length"),
    (dict(prompt=""), "empty"),
    (dict(input_ids=[]), "input_ids"),
    (dict(input_ids=[5, 512]), "512"),
    (dict(input_ids=[5, -1]), "-1"),
    (dict(input_ids=[5, 6], sampling_params={"temperature": -0.1}), "temperature"),
    (dict(input_ids=[5, 6], sampling_params={"top_p": 0.0}), "top_p"),
    (dict(input_ids=[5, 6], sampling_params={"top_p": 1.5}), "top_p"),
    (dict(input_ids=[5, 6], sampling_params={"top_k": 0}), "top_k"),
    (dict(input_ids=[5, 6], sampling_params={"min_p": 2.0}), "min_p"),
    (dict(input_ids=[5, 6], sampling_params={"n": 0}), "n"),
    (dict(input_ids=[5, 6], sampling_params={"temperature": "hot"}), "temperature"),
    (dict(input_ids=[5, 6], sampling_params={"temperature": float("nan")}), "finite"),
    (dict(input_ids=[5, 6], sampling_params={"stop_token_ids": [9999]}), "stop_token_ids"),
    (dict(input_ids=[5, 6], sampling_params={"repetition_penalty": 2.5}), "repetition_penalty"),
    (dict(input_ids=[5, 6], sampling_params={"frequency_penalty": -3}), "frequency_penalty"),
    (dict(input_ids=[5, 6], sampling_params={"logit_bias": {"x": 1}}), "logit_bias"),
    (dict(input_ids=[5, 6], sampling_params={"logit_bias": {"9999": 1}}), "logit_bias"),
    (dict(input_ids=[5, 6], sampling_params={"regex": "([a"}), "Invalid grammar request"),
    (dict(input_ids=[5, 6], sampling_params={"regex": "a+", "min_new_tokens": 2}), "grammar"),
    (dict(input_ids=[5, 6], sampling_params={"custom_params": [1]}), "custom_params"),
    (dict(input_ids=[5, 6], return_logprob=True, logprob_start_len=3), "logprob_start_len"),
    (dict(input_ids=[5, 6], sampling_params=[{}, {}]), "sampling_params"),
    (dict(prompt="hi", input_ids=[5]), "exactly one"),
    (dict(input_ids=[5, 6], top_logprobs_num=-1), "top_logprobs_num"),
]


@pytest.fixture(scope="module")
def engine(make_model):
    path = make_model("llama", max_position_embeddings=256)
    with Engine(model_path=path, random_seed=0, max_total_tokens=1024) as e:
        yield e


@pytest.mark.parametrize("kwargs,needle", BAD_REQUESTS, ids=[n for _, n in BAD_REQUESTS])
def test_bad_request_is_refused_with_a_clear_message(engine, kwargs, needle):
    with pytest.raises(ValueError) as err:
        engine.generate(**kwargs)
    assert needle in str(err.value)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2


def test_request_larger_than_the_kv_pool_is_refused_not_left_hanging(make_model):
    path = make_model("llama", max_position_embeddings=256)
    with Engine(model_path=path, random_seed=0, max_total_tokens=64) as small:
        with pytest.raises(ValueError, match="KV cache holds 64"):
            small.generate(input_ids=[5] * 40, sampling_params={"max_new_tokens": 40})
        assert (
            len(
                small.generate(input_ids=[5] * 40, sampling_params={"max_new_tokens": 20})[
                    "output_ids"
                ]
            )
            == 20
        )


def test_stop_strings_need_a_tokenizer(make_model):
    with Engine(model_path=make_model("llama"), random_seed=0, skip_tokenizer_init=True) as e:
        with pytest.raises(ValueError, match="stop_token_ids"):
            e.generate(input_ids=[5, 6], sampling_params={"stop": ["x"]})
        with pytest.raises(ValueError, match="tokenizer"):
            e.generate(prompt="hello")
        out = e.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
        assert out["text"] is None and len(out["output_ids"]) == 2
