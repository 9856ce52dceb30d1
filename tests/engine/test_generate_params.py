"""SGLang's /generate parameters that change the distribution or what is reported: penalties
and logit_bias (transformers' logits processors as the oracle, speculative decoding lossless
with them), prompt scoring (logprob_start_len, max_new_tokens 0) against transformers, and
slime's top-p replay under speculation."""

from __future__ import annotations

import base64
from array import array

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from spec_engine import Engine
from tiny.checkpoints import build_eagle_draft

PROMPT = [5, 9, 14, 22, 30, 41, 5, 9]
PENALIZED = {
    "temperature": 0,
    "max_new_tokens": 16,
    "repetition_penalty": 1.3,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.3,
    "logit_bias": {"7": 3.0, "9": -1.0},
}


@pytest.fixture(scope="module")
def target(make_model) -> str:
    return make_model("llama", num_layers=4)


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, random_seed=0, chunked_prefill_size=4) as engine:
        yield engine


def reference_greedy(model, params: dict, steps: int) -> list[int]:
    """Greedy decoding with SGLang's penalty rules built from transformers' processors:
    frequency/presence subtracted per output-token count, then the repetition penalty over
    output tokens (HF's processor given only those), then logit bias as a one-token sequence
    bias."""
    out: list[int] = []
    bias = SequenceBiasLogitsProcessor({(int(t),): b for t, b in params["logit_bias"].items()})
    repetition = RepetitionPenaltyLogitsProcessor(params["repetition_penalty"])
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + out])).logits[:, -1].float()
        if out:
            # SGLang's order: the additive penalties, then the repetition scaling.
            seen = torch.tensor([out])
            counts = torch.bincount(seen[0], minlength=logits.shape[-1]).float()
            logits = logits - params["frequency_penalty"] * counts
            logits = logits - params["presence_penalty"] * (counts > 0).float()
            logits = repetition(seen, logits)
        logits = bias(torch.tensor([PROMPT + out]), logits)
        out.append(int(logits.argmax()))
    return out


def test_penalties_and_logit_bias_follow_sglangs_rules(plain, target, hf):
    out = plain.generate(input_ids=PROMPT, sampling_params=PENALIZED, return_logprob=True)
    assert out["output_ids"] == reference_greedy(hf.model(target), PENALIZED, 16)
    free = plain.generate(
        input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 16}
    )
    assert free["output_ids"] != out["output_ids"]


@pytest.mark.parametrize(
    "spec",
    [
        dict(speculative_algorithm="NGRAM"),
        dict(
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=6,
        ),
        dict(speculative_algorithm="STANDALONE", speculative_num_steps=3),
    ],
    ids=["ngram", "eagle-tree", "standalone"],
)
def test_speculation_stays_lossless_with_penalties(plain, target, tmp_path_factory, spec):
    """Each verify row is penalised with the draft path above it: greedy outputs and their
    log-probs equal plain decoding."""
    if spec["speculative_algorithm"] == "EAGLE":
        spec["speculative_draft_model_path"] = build_eagle_draft(
            str(tmp_path_factory.mktemp("eagle")), target
        )
    if spec["speculative_algorithm"] == "STANDALONE":
        spec["speculative_draft_model_path"] = target
    expected = plain.generate(input_ids=PROMPT, sampling_params=PENALIZED, return_logprob=True)
    with Engine(model_path=target, random_seed=0, **spec) as engine:
        got = engine.generate(input_ids=PROMPT, sampling_params=PENALIZED, return_logprob=True)
    assert got["output_ids"] == expected["output_ids"]
    assert got["meta_info"]["spec_verify_ct"] < 16
    lps = [e[0] for e in got["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx(
        [e[0] for e in expected["meta_info"]["output_token_logprobs"]], abs=1e-4
    )


def test_prompt_scoring_matches_transformers(plain, target, hf):
    """logprob_start_len + max_new_tokens 0 (slime's distillation request): the prompt's
    log-probs at the request's temperature, chunked prefill (4 tokens per chunk) and a cached
    prefix notwithstanding; top log-probs too."""
    with torch.no_grad():
        logits = hf.model(target)(torch.tensor([PROMPT])).logits[0].double()
    expected = torch.log_softmax(logits[:-1] / 0.7, -1)
    plain.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2})  # caches the prompt
    out = plain.generate(
        input_ids=PROMPT,
        sampling_params={"temperature": 0.7, "max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
    )
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == PROMPT and entries[0][0] is None
    got = torch.tensor([lp for lp, _, _ in entries[1:]], dtype=torch.float64)
    torch.testing.assert_close(
        got, expected.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0], atol=1e-4, rtol=0
    )
    tops = meta["input_top_logprobs"]
    assert tops[0] is None
    assert [t for _, t, _ in tops[3]] == expected[2].topk(3).indices.tolist()
    later = plain.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=5,
    )
    assert [t for _, t, _ in later["meta_info"]["input_token_logprobs"]] == PROMPT[5:]


def test_top_p_replay_under_speculation(target):
    """slime's custom_params {"return_top_p_token_ids": true}: each emitted token lies in its
    nucleus, offsets as slime checks them, log-probs renormalised over the nucleus."""
    params = {
        "temperature": 1.0,
        "top_p": 0.7,
        "max_new_tokens": 12,
        "ignore_eos": True,
        "custom_params": {"return_top_p_token_ids": True},
    }
    with Engine(model_path=target, random_seed=0, speculative_algorithm="NGRAM") as engine:
        out = engine.generate(input_ids=PROMPT * 3, sampling_params=params, return_logprob=True)
    meta = out["meta_info"]
    ids = list(array("i", base64.b64decode(meta["top_p_token_ids"])))
    offsets = list(array("i", base64.b64decode(meta["top_p_token_offsets"])))
    assert offsets[0] == 0 and offsets[-1] == len(ids) and len(offsets) == 13
    for i, (lp, token, _) in enumerate(meta["output_token_logprobs"]):
        nucleus = ids[offsets[i] : offsets[i + 1]]
        assert token in nucleus and lp <= 0.0
        if len(nucleus) == 1:
            assert lp == pytest.approx(0.0, abs=1e-6)


def test_tiny_temperatures_decode_greedily(plain):
    """Any temperature > 0 is valid: below SGLang's 1e-6 it is greedy, with finite log-probs."""
    greedy = plain.generate(
        input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 8}
    )
    for t in (1e-40, 1e-7):
        out = plain.generate(
            input_ids=PROMPT,
            sampling_params={"temperature": t, "max_new_tokens": 8},
            return_logprob=True,
        )
        assert out["output_ids"] == greedy["output_ids"]
        assert all(-1e4 < lp <= 0 for lp, _, _ in out["meta_info"]["output_token_logprobs"])
