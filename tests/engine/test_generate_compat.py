"""SGLang's /generate, field by field, against oracles nobody here wrote: transformers' model
and logits processors (penalties, logit_bias, top-p nucleus, prompt log-probs), transformers'
tokenizer (log-prob texts), and slime's own checks on its top-p replay data. Penalties stay
lossless under every speculative algorithm; refusals are 400s naming the field."""

from __future__ import annotations

import base64
import threading
import time
from array import array
from typing import Any, Optional

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopPLogitsWarper,
)

from spec_engine import Engine
from spec_engine.server.http_server import create_app
from tiny.checkpoints import add_mimo_mtp, build_checkpoint, build_eagle_draft

PROMPT = [5, 9, 14, 22, 30, 41, 5, 9, 61, 77]
GREEDY = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
PENALTY_CASES = {
    "repetition": {"repetition_penalty": 1.8},
    "repetition-below-1": {"repetition_penalty": 0.6},
    "frequency": {"frequency_penalty": 1.5},
    "presence": {"presence_penalty": -2.0},
    "logit-bias": {"logit_bias": {"7": 4.0, "9": -2.5}},
    "all": {
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.6,
        "presence_penalty": 0.4,
        "logit_bias": {"33": 2.0},
    },
}


@pytest.fixture(scope="module")
def models(make_model, tmp_path_factory) -> dict[str, str]:
    target = make_model("llama", num_layers=4)
    root = tmp_path_factory.mktemp("compat")
    return {
        "target": target,
        "eagle": build_eagle_draft(str(root / "eagle"), target, version=2),
        "eagle3": build_eagle_draft(str(root / "eagle3"), target, version=3, draft_vocab_size=128),
        "small": build_checkpoint(str(root / "small"), arch="llama", num_layers=1, seed=5),
        "mimo": add_mimo_mtp(make_model("qwen2", num_layers=2, seed=13)),
    }


@pytest.fixture(scope="module")
def plain(models):
    # Chunks of 4 prompt tokens: prompt scoring must join them.
    with Engine(model_path=models["target"], random_seed=0, chunked_prefill_size=4) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(plain):
    return TestClient(create_app(plain))


def position_logits(hf, path: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' logits for each output position (row i predicts output token i)."""
    with torch.no_grad():
        logits = hf.model(path)(torch.tensor([prompt + output])).logits[0].double()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def sglang_penalised(logits: torch.Tensor, output: list[int], sp: dict) -> torch.Tensor:
    """SGLang's penalties for one row from transformers' processors: frequency/presence over the
    output so far, then the repetition penalty (HF's processor given the output only: SGLang
    does not count the prompt, HF's generate does), then logit_bias as one-token sequence bias."""
    row = logits[None].clone()
    if output:
        seen = torch.tensor([output])
        counts = torch.bincount(seen[0], minlength=row.shape[-1]).double()
        row = row - sp.get("frequency_penalty", 0.0) * counts
        row = row - sp.get("presence_penalty", 0.0) * (counts > 0).double()
        row = RepetitionPenaltyLogitsProcessor(sp.get("repetition_penalty", 1.0))(seen, row)
    if sp.get("logit_bias"):
        bias = {(int(t),): b for t, b in sp["logit_bias"].items()}
        row = SequenceBiasLogitsProcessor(bias)(torch.tensor([[0]]), row)
    return row[0]


def check_against_oracle(hf, path: str, out: dict, sp: dict, prompt: list[int]) -> None:
    """Every greedy token is the argmax of the oracle's penalised logits, and its reported
    log-prob is the log-softmax of those logits."""
    ids = out["output_ids"]
    logits = position_logits(hf, path, prompt, ids)
    for i, (token, (lp, t, _)) in enumerate(zip(ids, out["meta_info"]["output_token_logprobs"])):
        row = sglang_penalised(logits[i], ids[:i], sp)
        assert t == token == int(row.argmax()), f"token {i}"
        assert lp == pytest.approx(float(torch.log_softmax(row, -1)[token]), abs=1e-4)


@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_penalties_and_logit_bias_match_transformers(plain, models, hf, case):
    sp = {**GREEDY, **PENALTY_CASES[case]}
    out = plain.generate(input_ids=PROMPT, sampling_params=sp, return_logprob=True)
    check_against_oracle(hf, models["target"], out, sp, PROMPT)
    free = plain.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert out["output_ids"] != free["output_ids"], "the parameter changed nothing"


SPEC = {
    "eagle": ("target", dict(speculative_algorithm="EAGLE", speculative_draft_model_path="eagle",
                             speculative_num_steps=3, speculative_eagle_topk=2,
                             speculative_num_draft_tokens=6)),
    "eagle3": ("target", dict(speculative_algorithm="EAGLE3",
                              speculative_draft_model_path="eagle3", speculative_num_steps=3,
                              speculative_eagle_topk=2, speculative_num_draft_tokens=5)),
    "mtp": ("mimo", dict(speculative_algorithm="EAGLE", speculative_num_steps=3,
                         speculative_eagle_topk=1)),
    "standalone": ("target", dict(speculative_algorithm="STANDALONE",
                                  speculative_draft_model_path="target",
                                  speculative_num_steps=3, speculative_eagle_topk=2,
                                  speculative_num_draft_tokens=5)),
    "ngram": ("target", dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)),
}  # fmt: skip


def spec_engine(models: dict[str, str], name: str) -> Engine:
    target, kwargs = SPEC[name]
    if "speculative_draft_model_path" in kwargs:
        kwargs = {
            **kwargs,
            "speculative_draft_model_path": models[kwargs["speculative_draft_model_path"]],
        }
    return Engine(model_path=models[target], random_seed=0, **kwargs)


@pytest.mark.parametrize("name", list(SPEC))
def test_penalised_speculation_equals_plain_decoding(models, hf, name):
    """Each verify row is penalised with its draft path: greedy tokens and log-probs equal plain
    decoding's (and the oracle's where transformers loads the target; it has no MiMo). The
    fixtures' random EAGLE/EAGLE-3/MTP drafts are always rejected, so accepted draft paths are
    exercised by STANDALONE (the target drafting for itself, through the same EagleWorker) and
    NGRAM."""
    sp = {
        **GREEDY,
        "max_new_tokens": 24,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
        "logit_bias": {"33": 0.5},
    }
    prompt = PROMPT * 3  # repetitive, so n-gram drafts exist
    target = models[SPEC[name][0]]
    with Engine(model_path=target, random_seed=0) as engine:
        expected = engine.generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
        free = engine.generate(
            input_ids=prompt,
            sampling_params={
                **sp,
                "repetition_penalty": 1.0,
                "frequency_penalty": 0,
                "presence_penalty": 0,
                "logit_bias": None,
            },
        )
    with spec_engine(models, name) as engine:
        out = engine.generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
        # Again: NGRAM now drafts from the first answer, so whole paths are accepted.
        again = engine.generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
    assert again["output_ids"] == out["output_ids"]
    assert out["output_ids"] == expected["output_ids"] != free["output_ids"]
    lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx(
        [lp for lp, _, _ in expected["meta_info"]["output_token_logprobs"]], abs=1e-4
    )
    if name != "mtp":
        check_against_oracle(hf, target, out, sp, prompt)
    if name in ("standalone", "ngram"):
        assert again["meta_info"]["spec_verify_ct"] <= 12, "too few draft tokens were accepted"


def slime_top_p_rows(meta: dict, generated: int) -> Optional[list[list[int]]]:
    """slime's _extract_rollout_top_p_token_data (slime/utils/types.py): both keys or neither,
    int32 base64, offsets[0] == 0, offsets[-1] == len(ids), len(offsets) == generated + 1."""
    if "top_p_token_ids" not in meta and "top_p_token_offsets" not in meta:
        return None
    ids = list(array("i", base64.b64decode(meta["top_p_token_ids"])))
    offsets = list(array("i", base64.b64decode(meta["top_p_token_offsets"])))
    assert offsets[0] == 0 and offsets[-1] == len(ids) and len(offsets) == generated + 1
    return [ids[a:b] for a, b in zip(offsets, offsets[1:])]


TOP_P = {
    "temperature": 0.8,
    "top_p": 0.6,
    "max_new_tokens": 16,
    "ignore_eos": True,
    "custom_params": {"return_top_p_token_ids": True},
}


@pytest.mark.parametrize("name", ["plain", "ngram", "eagle"])
def test_top_p_replay_is_transformers_nucleus(plain, models, hf, name):
    """Each token's nucleus is transformers' TopPLogitsWarper's kept set (most probable first),
    the token inside it; its log-prob is renormalised over the nucleus, as slime's patch does."""
    prompt = PROMPT * 2
    if name == "plain":
        out = plain.generate(input_ids=prompt, sampling_params=TOP_P, return_logprob=True)
    else:
        with spec_engine(models, name) as engine:
            out = engine.generate(input_ids=prompt, sampling_params=TOP_P, return_logprob=True)
    ids = out["output_ids"]
    rows = slime_top_p_rows(out["meta_info"], len(ids))
    logits = position_logits(hf, models["target"], prompt, ids) / TOP_P["temperature"]
    kept = TopPLogitsWarper(TOP_P["top_p"])(None, logits.clone()).isfinite()
    probs = torch.softmax(logits, -1)
    assert any(len(r) > 1 for r in rows)
    for i, (lp, token, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        nucleus = kept[i].nonzero()[:, 0]
        expected = nucleus[probs[i, nucleus].argsort(descending=True)].tolist()
        assert rows[i] == expected and token in expected
        renormed = torch.log(probs[i, token] / probs[i, expected].sum())
        assert lp == pytest.approx(float(renormed), abs=1e-4)


def test_top_p_replay_only_when_asked(plain):
    greedy = {**TOP_P, "temperature": 0}
    out = plain.generate(input_ids=PROMPT, sampling_params=greedy, return_logprob=True)
    rows = slime_top_p_rows(out["meta_info"], len(out["output_ids"]))
    assert rows == [[t] for t in out["output_ids"]]  # greedy: the nucleus is the token
    assert all(
        lp == pytest.approx(0.0, abs=1e-6) for lp, _, _ in out["meta_info"]["output_token_logprobs"]
    )
    for sp in ({**TOP_P, "top_p": 1.0}, {**TOP_P, "custom_params": {"other": 1}}):
        out = plain.generate(input_ids=PROMPT, sampling_params=sp)
        assert slime_top_p_rows(out["meta_info"], len(out["output_ids"])) is None
    # Streaming: the ids come only with the finish reason, as slime's patch sends them.
    chunks = list(plain.generate(input_ids=PROMPT, sampling_params=TOP_P, stream=True))
    assert all("top_p_token_ids" not in c["meta_info"] for c in chunks[:-1])
    assert len(slime_top_p_rows(chunks[-1]["meta_info"], 16)) == 16


def prompt_logprob_oracle(hf, path: str, prompt: list[int], t: float) -> list[float]:
    with torch.no_grad():
        logits = hf.model(path)(torch.tensor([prompt])).logits[0].double()
    logp = torch.log_softmax(logits[:-1] / t, -1)
    return logp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


def test_prompt_logprobs_match_transformers_despite_cache_and_chunks(plain, models, hf):
    prompt = PROMPT + [100, 101, 102]
    expected = prompt_logprob_oracle(hf, models["target"], prompt, 0.7)
    plain.flush_cache()
    plain.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})  # caches it
    sp = {"temperature": 0.7, "max_new_tokens": 0}
    out = plain.generate(
        input_ids=prompt,
        sampling_params=sp,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    )
    entries = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in entries] == prompt and entries[0][0] is None
    assert [lp for lp, _, _ in entries[1:]] == pytest.approx(expected, abs=1e-4)
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["meta_info"]["input_top_logprobs"][0] is None
    assert [len(top) for top in out["meta_info"]["input_top_logprobs"][1:]] == [2] * 12
    # From position 6: SGLang's shape (entry 0 None), the prefix before it from the cache.
    out = plain.generate(
        input_ids=prompt, sampling_params=sp, return_logprob=True, logprob_start_len=6
    )
    entries = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in entries] == prompt[6:] and entries[0][0] is None
    assert [lp for lp, _, _ in entries[1:]] == pytest.approx(expected[6:], abs=1e-4)
    assert out["meta_info"]["cached_tokens"] == 6
    end = plain.generate(
        input_ids=prompt, sampling_params=sp, return_logprob=True, logprob_start_len=len(prompt)
    )
    assert end["meta_info"]["input_token_logprobs"] == []
    # A batch with per-prompt log-prob fields (SGLang's lists).
    outs = plain.generate(
        input_ids=[prompt, PROMPT],
        sampling_params=sp,
        return_logprob=[True, False],
        logprob_start_len=[3, -1],
    )
    assert [t for _, t, _ in outs[0]["meta_info"]["input_token_logprobs"]] == prompt[3:]
    assert "input_token_logprobs" not in outs[1]["meta_info"]


@pytest.mark.parametrize("name", ["eagle", "ngram"])
def test_prompt_logprobs_under_speculation(models, hf, name):
    expected = prompt_logprob_oracle(hf, models["target"], PROMPT, 1.0)
    with spec_engine(models, name) as engine:
        outs = [
            engine.generate(
                input_ids=PROMPT,
                sampling_params={"max_new_tokens": n},
                return_logprob=True,
                logprob_start_len=0,
            )
            for n in (3, 0)
        ]
        sp = {"temperature": 0.7, "max_new_tokens": 6, "ignore_eos": True}
        chosen = engine.generate(
            input_ids=PROMPT, sampling_params=sp, return_logprob=True, token_ids_logprob=[9, 5]
        )
    # token_ids_logprob from the verify's rows: transformers' log-softmax at each position.
    logp = torch.log_softmax(
        position_logits(hf, models["target"], PROMPT, chosen["output_ids"]) / 0.7, -1
    )
    got = chosen["meta_info"]["output_token_ids_logprobs"]
    assert len(got) == 6 and [[t for _, t, _ in e] for e in got] == [[9, 5]] * 6
    want = [float(v) for row in logp for v in (row[9], row[5])]
    assert [lp for e in got for lp, _, _ in e] == pytest.approx(want, abs=1e-4)
    for out, n in zip(outs, (3, 0)):
        got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
        assert got == pytest.approx(expected, abs=1e-4)
        assert len(out["output_ids"]) == n


def test_token_ids_logprob_is_transformers_log_softmax_in_sglangs_shape(client, models, hf):
    # SGLang's test_srt_endpoint.py token_ids_logprob: one id list for every prompt, or one each.
    chosen = [[5, 9, 300], [7]]
    sp = {"temperature": 0.7, "max_new_tokens": 4, "ignore_eos": True}
    prompts = [PROMPT, PROMPT[:6]]
    for ids_arg in (chosen[0], chosen):
        body = {"input_ids": prompts, "sampling_params": sp, "return_logprob": True}
        r = client.post("/generate", json={**body, "token_ids_logprob": ids_arg})
        assert r.status_code == 200, r.text
        for k, (prompt, out) in enumerate(zip(prompts, r.json())):
            want_ids = ids_arg[k] if isinstance(ids_arg[0], list) else ids_arg
            logp = torch.log_softmax(
                position_logits(hf, models["target"], prompt, out["output_ids"]) / 0.7, -1
            )
            got = out["meta_info"]["output_token_ids_logprobs"]
            assert len(got) == len(out["output_ids"]) == 4
            for row, entries in zip(logp, got):
                assert [(t, text) for _, t, text in entries] == [(t, None) for t in want_ids]
                want = [float(row[t]) for t in want_ids]
                assert [lp for lp, _, _ in entries] == pytest.approx(want, abs=1e-4)
    # With logprob_start_len: the prompt's too, SGLang's first entry null.
    r = client.post(
        "/generate",
        json={**body, "token_ids_logprob": [5, 9], "logprob_start_len": 3, "input_ids": PROMPT},
    )
    got = r.json()["meta_info"]["input_token_ids_logprobs"]
    assert len(got) == len(PROMPT) - 3 and got[0] is None
    rows = position_logits(hf, models["target"], PROMPT[:1], PROMPT[1:])  # row i: PROMPT[i + 1]
    logp = torch.log_softmax(rows / 0.7, -1)
    want = [float(v) for row in logp[3:] for v in (row[5], row[9])]
    assert [t for e in got[1:] for _, t, _ in e] == [5, 9] * (len(PROMPT) - 4)
    assert [lp for e in got[1:] for lp, _, _ in e] == pytest.approx(want, abs=1e-4)
    r = client.post("/generate", json={"input_ids": PROMPT, "token_ids_logprob": [5]})
    assert "output_token_ids_logprobs" not in r.json()["meta_info"]  # SGLang: return_logprob


def test_slime_distillation_request_over_http(client, models, hf):
    """on_policy_distillation.reward_func's body, read as slime reads it."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0.6, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    teacher = [item[0] for item in meta["input_token_logprobs"][1:]]
    assert teacher == pytest.approx(
        prompt_logprob_oracle(hf, models["target"], PROMPT, 0.6), abs=1e-4
    )
    assert r.json()["output_ids"] == [] and r.json()["text"] == ""
    assert meta["finish_reason"] == {"type": "length", "length": 0}


def test_text_in_logprobs_is_the_tokenizers(client, models):
    tok = AutoTokenizer.from_pretrained(models["target"])
    r = client.post(
        "/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {**GREEDY, "max_new_tokens": 4},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "logprob_start_len": 8,
            "return_text_in_logprobs": True,
        },
    )
    meta = r.json()["meta_info"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        assert [text for _, _, text in meta[key]] == [tok.decode([t]) for _, t, _ in meta[key]]
    tops = meta["output_top_logprobs"]
    assert all(text == tok.decode([t]) for top in tops for _, t, text in top)


def post(client: TestClient, sampling_params: Any, **body: Any) -> Any:
    """POST /generate for PROMPT (unless input_ids is given); the body must be a 200."""
    r = client.post(
        "/generate", json={"input_ids": PROMPT, "sampling_params": sampling_params, **body}
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_sglang_fields_work_over_http(client):
    """What slime's rollout sends, and SGLang's other per-request fields, by their effect."""
    slime_sp = dict(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=12, stop=None,
                    stop_token_ids=None, skip_special_tokens=False, no_stop_trim=True,
                    spaces_between_special_tokens=False)  # fmt: skip
    neutral = dict(rid="r1", stream=False, return_routed_experts=False, image_data=None,
                   lora_path=None, custom_logit_processor=None, data_parallel_rank=None,
                   session_params=None, bootstrap_host=None)  # fmt: skip
    out = post(client, slime_sp, return_logprob=True, **neutral)
    assert out["meta_info"]["id"] == "r1" and len(out["meta_info"]["output_token_logprobs"]) == 12
    # sampling_seed: the same seed, the same samples; the n samples differ from one another.
    a, b = (post(client, {**slime_sp, "sampling_seed": 7, "n": 3}) for _ in range(2))
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert len({tuple(o["output_ids"]) for o in a}) == 3
    # Per-prompt sampling_params in a batch.
    sps = [{**GREEDY, "max_new_tokens": 3}, {**GREEDY, "max_new_tokens": 5}]
    outs = post(client, sps, input_ids=[PROMPT, PROMPT[:4]])
    assert [len(o["output_ids"]) for o in outs] == [3, 5]
    # Finish reasons in SGLang's shapes: a stop id (held back by min_new_tokens), a string.
    greedy = post(client, GREEDY)
    ids, text = greedy["output_ids"], greedy["text"]
    assert greedy["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    stopping = {**GREEDY, "ignore_eos": False, "stop_token_ids": [ids[2]]}
    out = post(client, stopping)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}
    assert out["output_ids"] == ids[: ids.index(ids[2]) + 1]
    assert "matched_stop" not in out["meta_info"]
    assert len(post(client, {**stopping, "min_new_tokens": 8})["output_ids"]) >= 8
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    for trim in (False, True):
        out = post(client, {**GREEDY, "stop": [stop], "no_stop_trim": trim})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["text"].endswith(stop) == trim and text.startswith(out["text"])


def test_abort_answers_200_with_the_partial_output(client, plain):
    result: dict[str, Any] = {}
    body = {
        "input_ids": PROMPT,
        "rid": "long",
        "return_logprob": True,
        "sampling_params": {**GREEDY, "max_new_tokens": 400},
    }
    thread = threading.Thread(target=lambda: result.update(r=client.post("/generate", json=body)))
    thread.start()
    deadline = time.time() + 30
    while not any(len(r.output_ids) > 2 for r in plain.scheduler.running):
        assert time.time() < deadline and thread.is_alive()
        time.sleep(0.005)
    plain.abort_request("long")
    thread.join(timeout=30)
    assert result["r"].status_code == 200
    out = result["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "message" in out["meta_info"]["finish_reason"]
    assert 2 < len(out["output_ids"]) < 400
    assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]


@pytest.mark.parametrize("spaces", [False, True])
@pytest.mark.parametrize("skip", [False, True])
def test_special_token_text_is_the_tokenizers(client, models, skip, spaces):
    """skip_special_tokens / spaces_between_special_tokens decode as transformers does; a
    logit_bias makes the output hold special tokens (<|im_start|>, <|im_end|>)."""
    tok = AutoTokenizer.from_pretrained(models["target"])
    specials = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    sp = {
        **GREEDY,
        "max_new_tokens": 8,
        "logit_bias": {str(specials[0]): 9.0, str(specials[1]): 9.0},
        "repetition_penalty": 2.0,
        "skip_special_tokens": skip,
        "spaces_between_special_tokens": spaces,
    }
    out = post(client, sp)
    assert set(specials) <= set(out["output_ids"])
    expected = tok.decode(
        out["output_ids"], skip_special_tokens=skip, spaces_between_special_tokens=spaces
    )
    assert out["text"] == expected and ("<|im_end|>" in expected) != skip


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"sampling_params": {"regex": "([a"}}, "req.grammar_key=('regex', '([a')"),
        ({"sampling_params": {"json_schema": "{bad"}}, "req.grammar_key=('json', '{bad')"),
        ({"sampling_params": {"ebnf": "root ::= "}}, "req.grammar_key=('ebnf', 'root ::= ')"),
        ({"sampling_params": {"regex": 1}}, "sampling_params.regex must be a string"),
        ({"return_routed_experts": True}, "return_routed_experts: the model has no MoE layers"),
        (
            {"custom_logit_processor": "gASV"},
            "not configured to enable custom logit processor",
        ),
        ({"image_data": "x.png"}, "image_data: specrl serves text-only models"),
        ({"lora_path": "adapter"}, "lora_path"),
        ({"session_params": {"id": "s"}}, "session_params"),
        ({"bootstrap_host": "h"}, "bootstrap_host"),
        ({"data_parallel_rank": 1}, "data_parallel_rank"),
        ({"no_such_field": 1}, "unknown field(s) ['no_such_field']"),
        ({"return_text_in_logprobs": "yes"}, "return_text_in_logprobs must be true or false"),
        ({"return_logprob": True, "logprob_start_len": 11}, "logprob_start_len 11 is past"),
        ({"return_logprob": [True, False]}, "return_logprob has 2 entries for 1 prompts"),
        ({"sampling_params": {"repetition_penalty": 0}}, "repetition_penalty must be in (0, 2]"),
        ({"sampling_params": {"frequency_penalty": 2.5}}, "frequency_penalty must be in [-2, 2]"),
        ({"sampling_params": {"presence_penalty": -3}}, "presence_penalty must be in [-2, 2]"),
        ({"sampling_params": {"logit_bias": {"x": 1}}}, "logit_bias must map token ids"),
        ({"sampling_params": {"logit_bias": {"99999": 1}}}, "logit_bias has token 99999"),
        ({"sampling_params": {"custom_params": [1]}}, "custom_params must be an object"),
    ],
)
def test_refusals_are_400s_naming_the_field(client, body, needle):
    r = client.post("/generate", json={"input_ids": PROMPT, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
