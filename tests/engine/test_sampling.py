"""Sampling follows the exact target distribution (transformers' logits warpers are the oracle)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from spec_engine import Engine
from spec_engine.core.request import Req, ReqInput
from spec_engine.core.sampling_params import SamplingParams
from spec_engine.core.worker import sampling_batch
from spec_engine.layers.sampler import Sampler, request_uniform

VOCAB = 16
CONFIGS = [
    {"temperature": 0.7},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 0.9, "top_p": 0.7},
    {"temperature": 1.3, "min_p": 0.1},
    {"temperature": 0.8, "top_k": 6, "top_p": 0.8},
    {"temperature": 1.1, "top_k": 8, "top_p": 0.9, "min_p": 0.25},
]


def expected_probs(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """The target distribution as transformers' generate() builds it (same warper order)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))
    scores = warpers(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())
    return torch.softmax(scores, -1)[0]


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; a sample outside the expected support gives p = 0."""
    n = counts.sum()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs[support] * n
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2)
    )


def draw(logits: torch.Tensor, params: dict, n: int) -> tuple[torch.Tensor, list[float], list[int]]:
    sp = SamplingParams(**params)
    reqs = [
        Req(
            ReqInput(
                rid=str(i),
                origin_input_ids=(0,),
                sampling_params=sp,
                seed=1000 + i,
                return_logprob=True,
            )
        )
        for i in range(n)
    ]
    batch = sampling_batch(reqs, VOCAB, torch.device("cpu"))
    out = Sampler()(logits[None].expand(n, -1).contiguous(), batch)
    return (
        torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).double(),
        out.logprobs,
        out.token_ids,
    )


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 2.0


@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_sampler_matches_exact_distribution(logits, params):
    counts, logprobs, tokens = draw(logits, params, 40000)
    assert chi2_pvalue(counts, expected_probs(logits, **params)) > 1e-4
    # Returned log-probs are the unfiltered log-softmax at the request's temperature.
    ref = torch.log_softmax(logits / params["temperature"], -1)
    assert max(abs(lp - ref[t].item()) for lp, t in zip(logprobs[:100], tokens[:100])) < 1e-5


def binding_filters(logits: torch.Tensor, params: dict) -> list[str]:
    """Filters whose removal changes the target distribution (a non-binding one changes nothing)."""
    target = expected_probs(logits, **params)
    return [
        k
        for k in params
        if k != "temperature"
        and (expected_probs(logits, **{a: b for a, b in params.items() if a != k}) - target)
        .abs()
        .max()
        > 0.01
    ]


def test_every_filter_is_binding_somewhere(logits):
    covered = {f for params in CONFIGS for f in binding_filters(logits, params)}
    assert covered == {"top_k", "top_p", "min_p"}


@pytest.mark.parametrize("params", [p for p in CONFIGS if len(p) > 1], ids=lambda p: "-".join(p))
def test_dropping_a_binding_filter_would_be_detected(logits, params):
    """The statistical test has power: the distribution without a binding filter is rejected."""
    counts, _, _ = draw(logits, params, 40000)
    dropped_filters = binding_filters(logits, params)
    assert dropped_filters
    for dropped in dropped_filters:
        without = {k: v for k, v in params.items() if k != dropped}
        assert chi2_pvalue(counts, expected_probs(logits, **without)) < 1e-6, (
            f"dropping {dropped} went unnoticed"
        )


def test_greedy_rows_and_uniforms(logits):
    counts, logprobs, tokens = draw(logits, {"temperature": 0.0}, 50)
    assert set(tokens) == {int(logits.argmax())}
    assert abs(logprobs[0] - torch.log_softmax(logits, -1).max().item()) < 1e-6
    u = [request_uniform(7, i) for i in range(20000)]
    assert 0.0 <= min(u) and max(u) < 1.0 and abs(sum(u) / len(u) - 0.5) < 0.01
    assert request_uniform(7, 3) == request_uniform(7, 3) != request_uniform(8, 3)


def test_engine_first_token_follows_target_distribution(llama_path, hf):
    prompt = [5, 17, 99, 230, 41, 8]
    params = {"temperature": 0.8, "top_k": 12, "top_p": 0.9}
    expected = expected_probs(hf.next_token_logits(llama_path, prompt), **params)
    with Engine(model_path=llama_path, random_seed=3) as engine:
        outs = engine.generate(
            input_ids=prompt, sampling_params={**params, "max_new_tokens": 1, "n": 3000}
        )
    tokens = torch.tensor([o["output_ids"][0] for o in outs])
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    assert chi2_pvalue(counts, expected) > 1e-4
    unfiltered = expected_probs(hf.next_token_logits(llama_path, prompt), temperature=0.8)
    assert chi2_pvalue(counts, unfiltered) < 1e-6


def test_top_k_one_is_greedy_with_logprobs_at_the_temperature(logits):
    _, logprobs, tokens = draw(logits, {"temperature": 0.7, "top_k": 1}, 20)
    assert set(tokens) == {int(logits.argmax())}
    assert abs(logprobs[0] - torch.log_softmax(logits / 0.7, -1).max().item()) < 1e-6
