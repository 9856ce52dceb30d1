"""A server driven as slime drives SGLang: its request shapes and the checks it runs on the
answers (slime/rollout/sglang_rollout.py, slime/utils/types.py, server_control.py,
update_weight_from_tensor.py, on_policy_distillation.py; quoted in docs/sglang_compat.md), and
the official openai client. One real server process, MiMo with MTP speculation as slime's page
runs it; oracles: transformers and a fresh engine."""

from __future__ import annotations

import base64
import threading
import time
from array import array
from typing import Any

import pytest
import torch

from tests.support.slime_wire import install_fake_sglang, slime_payload
from tiny.checkpoints import add_mimo_mtp

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.support.server_process import served  # noqa: E402 (needs httpx)
from trainer_bridge.megatron_compat import free_port  # noqa: E402

PROMPT = "copy: a b c"


@pytest.fixture(scope="module")
def mimo(make_model) -> str:
    return add_mimo_mtp(make_model("qwen2", num_layers=2, seed=21), seed=22)


@pytest.fixture(scope="module")
def trunk(mimo):
    """transformers' Qwen2 on the MiMo checkpoint: the target without its MTP layer (the
    oracle for log-probs)."""
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(mimo).eval()


@pytest.fixture(scope="module")
def server(mimo):
    cmd = [
        "--model-path",
        mimo,
        "--random-seed",
        "0",
        "--max-total-tokens",
        "4096",
        # slime's page: SGLANG_ARGS for speculative decoding with the MTP layer
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
        "--enable-metrics",
        "--log-level",
        "warning",
    ]
    with served(cmd, free_port()) as url:
        yield url


def post(url: str, path: str, body: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
    """slime's _post: raise_for_status, then the JSON body."""
    resp = httpx.post(url + path, json=body, timeout=timeout)
    resp.raise_for_status()
    return resp.json()


def slime_sampling_params(top_p: float, max_new_tokens: int) -> dict[str, Any]:
    """GenerateState.__init__'s sampling_params for --rollout-top-p `top_p`."""
    params: dict[str, Any] = dict(
        temperature=1.0,
        top_p=top_p,
        top_k=-1,
        max_new_tokens=max_new_tokens,
        stop=None,
        stop_token_ids=None,
        skip_special_tokens=False,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
    )
    if top_p != 1.0:
        params["custom_params"] = {"return_top_p_token_ids": True}
    return params


def decode_int32(value: Any) -> list[int]:
    """slime's decode_int32_meta_array: base64 of little-endian int32, or a JSON list."""
    if isinstance(value, list):
        return [int(v) for v in value]
    return list(array("i", base64.b64decode(value)))


def extract_top_p(meta: dict[str, Any], generated: int) -> tuple[list[int], list[int]]:
    """slime's _extract_rollout_top_p_token_data checks."""
    ids = meta.get("top_p_token_ids", meta.get("top_p_kept_token_ids"))
    offsets = meta.get("top_p_token_offsets", meta.get("top_p_kept_token_offsets"))
    assert ids is not None and offsets is not None, "rollout_top_p != 1.0 needs both keys"
    ids, offsets = decode_int32(ids), decode_int32(offsets)
    assert offsets[0] == 0 and offsets[-1] == len(ids)
    assert len(offsets) == generated + 1, "offsets length must equal generated token count + 1"
    return ids, offsets


def test_rollout_with_top_p_gives_what_slimes_loss_needs(server, mimo, trunk):
    """--rollout-top-p 0.9: tokens and log-probs from output_token_logprobs, the nucleus of each
    token (it holds the token), log-probs renormalised over it as slime's trainer recomputes."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(mimo)(PROMPT)["input_ids"]
    payload = {
        "input_ids": ids,
        "sampling_params": slime_sampling_params(0.9, 12),
        "return_logprob": True,
    }
    out = post(server, "/generate", payload)
    meta = out["meta_info"]
    assert isinstance(out["text"], str)
    tokens = [item[1] for item in meta["output_token_logprobs"]]
    log_probs = [item[0] for item in meta["output_token_logprobs"]]
    assert tokens == out["output_ids"] and len(tokens) == meta["completion_tokens"] == 12
    assert meta["finish_reason"]["type"] == "length"
    assert meta["spec_verify_ct"] > 0 and meta["weight_version"] == "default"
    nucleus_ids, offsets = extract_top_p(meta, len(tokens))
    with torch.no_grad():
        logits = trunk(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].double()
    for i, (token, lp) in enumerate(zip(tokens, log_probs)):
        kept = nucleus_ids[offsets[i] : offsets[i + 1]]
        assert token in kept
        probs = torch.softmax(logits[i], -1)
        # The nucleus: most probable tokens while the mass before each is <= top_p.
        order = probs.argsort(descending=True).tolist()
        assert sorted(kept) == sorted(order[: len(kept)])
        assert probs[kept[:-1]].sum() <= 0.9 + 1e-5 < probs[kept].sum() + 1e-5
        # slime's trainer: log-softmax over the nucleus (the target token forced in).
        expected = torch.log_softmax(logits[i][kept], -1)[kept.index(token)]
        assert lp == pytest.approx(float(expected), abs=1e-4)


def test_abort_then_partial_rollout_continuation(server):
    """slime's abort: {"abort_all": true} to each worker, then /v1/loads?include=core until no
    request is left; an aborted request answers 200 with its tokens so far and type "abort";
    continuing it (prompt + partial as input_ids, max_new_tokens reduced) gives, under greedy,
    the uninterrupted output."""
    ids = [5, 6, 7, 8]
    # 200 tokens: the abort, 0.2 s after the request starts running, comes mid-request
    greedy = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
    full = post(server, "/generate", {"input_ids": ids, "sampling_params": greedy})["output_ids"]
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["out"] = post(
            server,
            "/generate",
            {"input_ids": ids, "sampling_params": greedy, "return_logprob": True},
            timeout=120,
        )

    thread = threading.Thread(target=long_request)
    thread.start()
    while httpx.get(server + "/v1/loads?include=core").json()["loads"][0]["num_running_reqs"] == 0:
        time.sleep(0.01)
    time.sleep(0.2)
    # SGLang answers an abort with an empty 200.
    httpx.post(server + "/abort_request", json={"abort_all": True}).raise_for_status()
    thread.join(timeout=60)
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    partial = [item[1] for item in meta["output_token_logprobs"]]
    assert 0 < len(partial) < 200 and partial == full[: len(partial)]
    assert num_requests_from_load(httpx.get(server + "/v1/loads?include=core").json()) == 0
    rest = dict(greedy, max_new_tokens=200 - len(partial))
    cont = post(server, "/generate", {"input_ids": ids + partial, "sampling_params": rest})
    assert partial + cont["output_ids"] == full


def num_requests_from_load(load: Any) -> int:
    """slime's server_control.num_requests_from_load."""
    if isinstance(load, dict) and "loads" in load:
        return sum(num_requests_from_load(x) for x in load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running = load.get("num_running_reqs", load.get("total_running_reqs", 0))
    return running + load.get("num_waiting_reqs", load.get("total_waiting_reqs", 0))


def test_distillation_scoring(server, trunk):
    """on_policy_distillation.reward_func: max_new_tokens 0, logprob_start_len 0; slime reads
    input_token_logprobs[1:], the teacher's log-probs at the rollout temperature."""
    tokens = [5, 9, 14, 22, 30, 41]
    payload = {
        "input_ids": tokens,
        "sampling_params": {"temperature": 0.7, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    meta = post(server, "/generate", payload)["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == tokens and entries[0][0] is None
    with torch.no_grad():
        logits = trunk(torch.tensor([tokens])).logits[0].double()
    expected = torch.log_softmax(logits[:-1] / 0.7, -1).gather(1, torch.tensor(tokens[1:])[:, None])
    got = torch.tensor([e[0] for e in entries[1:]], dtype=torch.float64)
    torch.testing.assert_close(got, expected[:, 0], atol=1e-4, rtol=0)


def test_weight_update_as_slime_sends_it(server, mimo, make_model, monkeypatch):
    """pause_generation -> flush_cache -> update_weights_from_tensor (flattened bucket, one
    string per TP rank) -> continue_generation; the new weights serve (greedy equals a fresh
    engine on them) and get_weight_version reports slime's string version."""
    from safetensors.torch import load_file

    from spec_engine.engine import Engine

    torch.multiprocessing.set_sharing_strategy("file_system")
    metadata_cls = install_fake_sglang(monkeypatch)
    new = add_mimo_mtp(make_model("qwen2", num_layers=2, seed=31), seed=32)
    named = load_file(f"{new}/model.safetensors")
    post(server, "/pause_generation", {})
    assert httpx.get(server + "/flush_cache").status_code == 200
    payload = {
        "serialized_named_tensors": [slime_payload(named, metadata_cls)[0]],
        "load_format": "flattened_bucket",
        "flush_cache": False,
        "weight_version": "1",
    }
    assert post(server, "/update_weights_from_tensor", payload)["success"] is True
    post(server, "/continue_generation", {})
    assert httpx.get(server + "/get_weight_version").json()["weight_version"] == "1"
    request = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    served = post(server, "/generate", request)
    with Engine(model_path=new, speculative_algorithm="EAGLE", random_seed=0) as fresh:
        expected = fresh.generate(input_ids=[5, 6, 7], sampling_params=request["sampling_params"])
    assert served["output_ids"] == expected["output_ids"]
    assert served["meta_info"]["weight_version"] == "1"
    # An empty bucket (a rank with nothing to send) is a no-op.
    payload["serialized_named_tensors"] = [slime_payload({}, metadata_cls)[0]]
    payload["weight_version"] = "2"
    assert post(server, "/update_weights_from_tensor", payload)["success"] is True
    assert post(server, "/generate", request)["output_ids"] == expected["output_ids"]


def test_server_info_keys_slime_reads(server):
    info = httpx.get(server + "/server_info").json()
    assert set(info) == set(httpx.get(server + "/get_server_info").json())
    for key, value in (
        ("tp_size", 1),
        ("dp_size", 1),
        ("pp_size", 1),
        ("ep_size", 1),
        ("nnodes", 1),
        ("node_rank", 0),
        ("base_gpu_id", 0),
        ("gpu_id_step", 1),
        ("enable_memory_saver", False),
    ):
        assert info[key] == value, key
    assert isinstance(info["port"], int) and info["host"]
    metrics = httpx.get(server + "/metrics").text
    assert "sglang:prompt_tokens_total" in metrics


def test_official_openai_client(server, mimo):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    model = client.models.retrieve(mimo)
    assert model.id == mimo
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    completion = client.completions.create(
        model=mimo, prompt=PROMPT, max_tokens=6, n=2, seed=3, temperature=1.0, echo=True
    )
    assert len(completion.choices) == 2
    assert all(c.text.startswith(PROMPT) for c in completion.choices)
    again = client.completions.create(
        model=mimo, prompt=PROMPT, max_tokens=6, n=2, seed=3, temperature=1.0, echo=True
    )
    assert [c.text for c in again.choices] == [c.text for c in completion.choices]
    stream = client.completions.create(
        model=mimo,
        prompt=PROMPT,
        max_tokens=5,
        stream=True,
        logprobs=2,
        stream_options={"include_usage": True},
        temperature=0,
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    streamed_logprobs = [lp for c in chunks if c.choices for lp in c.choices[0].logprobs.tokens]
    assert len(streamed_logprobs) == 5
