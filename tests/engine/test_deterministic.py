"""--enable-deterministic-inference (SGLang's flag): a request's tokens and log-probs are the same
bits whether it runs alone, batched with other requests (eager or through padded graphs), or
after a prefix-cache hit; for plain decoding,
MoE models and per-request drafts (EAGLE trees, EAGLE-3, MTP, STANDALONE), greedy and sampled.
Without the flag they are not (what makes two RL runs drift apart)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from spec_engine import Engine
from spec_engine.args.engine_args import EngineArgs
from spec_engine.args.resolve import resolve_auto, resolve_speculative
from spec_engine.layers.batch_invariant import INVARIANT_ROWS
from spec_engine.layers.batch_invariant import linear as invariant_linear
from tests.conftest import FAMILIES, random_prompts
from tests.engine.test_speculative import models, spec_args  # noqa: F401  (module fixture)

TARGET = random_prompts(1, 37, 37, seed=7)[0]  # longer than a short extend: the per-request path
OTHERS = random_prompts(7, 4, 30, seed=8)
PARAMS = [
    {"temperature": 0, "max_new_tokens": 12},
    {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 12, "sampling_seed": 5},
]


def test_invariant_linear_rows_do_not_depend_on_the_row_count():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    x = torch.randn(3 * INVARIANT_ROWS + 5, 80, generator=g)
    row = x[2:3]
    alone = invariant_linear(row, weight, bias)
    for n in range(3, x.shape[0] + 1):
        assert torch.equal(invariant_linear(x[:n], weight, bias)[2:3], alone), n
    close = F.linear(x, weight, bias)
    assert torch.allclose(invariant_linear(x, weight, bias), close, atol=1e-5)
    assert invariant_linear(x.view(1, -1, 80), weight).shape == (1, x.shape[0], 96)


def _tokens_and_logprobs(out: dict) -> tuple[list[int], list[float]]:
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _outputs(path: str, kwargs: dict, **engine_kwargs) -> dict[str, list]:
    """The target request's (tokens, log-probs) per sampling setting: alone, eagerly; among
    other requests, through padded graphs; and again after the same prompt filled the cache."""

    def run(engine: Engine, prompts: list[list[int]], params: dict, at: int) -> tuple:
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        return _tokens_and_logprobs(outs[at] if isinstance(outs, list) else outs)

    base = dict(model_path=path, random_seed=0, max_total_tokens=4096, **kwargs, **engine_kwargs)
    results: dict[str, list] = {"alone": [], "batched": [], "cache hit": []}
    with Engine(**base, disable_cuda_graph=True, disable_radix_cache=True) as engine:
        results["alone"] = [run(engine, TARGET, p, 0) for p in PARAMS]
    with Engine(**base, max_running_requests=8, cuda_graph_bs=[1, 2, 4, 8]) as engine:
        for p in PARAMS:
            results["batched"].append(run(engine, OTHERS[:3] + [TARGET] + OTHERS[3:], p, 3))
            # The whole prompt is cached now: its last token is the only one computed.
            results["cache hit"].append(run(engine, TARGET, p, 0))
    return results


CASES = ["plain", "glm4_moe", "mtp", "eagle-tree-paged", "eagle3-draft-vocab", "standalone"]


@pytest.mark.parametrize("case", CASES)
def test_a_request_is_the_same_alone_batched_and_after_a_cache_hit(case, models, make_model):  # noqa: F811
    if case == "plain":
        path, kwargs = models["target"], {}
    elif case == "glm4_moe":
        path, kwargs = make_model(**FAMILIES["glm4_moe"]), {}
    else:
        path, kwargs = spec_args(models, case)
    results = _outputs(path, kwargs, enable_deterministic_inference=True)
    alone = results.pop("alone")
    assert all(len(tokens) == 12 for tokens, _ in alone)
    for where, got in results.items():
        assert got == alone, f"{case}: {where} differs from alone"


def test_sampled_speculative_requests_repeat_in_any_order(models):  # noqa: F811
    """Many sampled requests, several per prompt (as an RL rollout sends them), in two orders
    and one at a time: each request's tokens and log-probs are the same bits, although which
    request of a prompt hits the prefix cache depends on the order (and the MTP draft's KV at a
    position depends on the next token: the cache keys positions by both)."""
    path, kwargs = spec_args(models, "mtp")
    prompts = [p for p in random_prompts(6, 8, 30, seed=11) for _ in range(4)]
    params = [
        {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 100 + i}
        for i in range(len(prompts))
    ]
    base = dict(model_path=path, random_seed=0, enable_deterministic_inference=True, **kwargs)

    def run(order: list[int]) -> dict[int, tuple]:
        with Engine(**base, max_running_requests=16, cuda_graph_bs=[1, 2, 4, 8]) as engine:
            outs = engine.generate(
                input_ids=[prompts[i] for i in order],
                sampling_params=[params[i] for i in order],
                return_logprob=True,
            )
        assert sum(o["meta_info"]["cached_tokens"] > 0 for o in outs) >= 12
        return {i: _tokens_and_logprobs(o) for i, o in zip(order, outs)}

    order = list(range(len(prompts)))
    forward = run(order)
    assert run(order[::-1]) == forward
    with Engine(**base, disable_cuda_graph=True, disable_radix_cache=True) as engine:
        alone = {}
        for i in order[:8]:
            prompt, sp = prompts[i], params[i]
            out = engine.generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
            alone[i] = _tokens_and_logprobs(out)
    assert alone == {i: forward[i] for i in alone}


def test_without_the_flag_a_cache_hit_changes_the_bits(models):  # noqa: F811
    """The oracle above has teeth: SDPA tiles query rows, so the same token's log-prob changes
    with how many rows its forward computed."""
    results = _outputs(models["target"], {})
    differs = [where for where in ("batched", "cache hit") if results[where] != results["alone"]]
    assert differs, "plain kernels gave identical bits everywhere: the invariance test is vacuous"


def _resolved(**kwargs) -> EngineArgs:
    args = EngineArgs(model_path="m", enable_deterministic_inference=True, **kwargs)
    return resolve_auto(args, cuda_available=True, checkpoint_dtype="bfloat16", head_dim=128)


def test_deterministic_inference_runs_torch_native_and_refuses_what_breaks_it(monkeypatch):
    monkeypatch.setattr("spec_engine.args.resolve.flashinfer_installed", lambda: True)
    assert _resolved().attention_backend == "torch_native"  # auto would pick flashinfer here
    with pytest.raises(ValueError, match="implements in torch_native only: drop --attention-back"):
        _resolved(attention_backend="flashinfer")
    ngram = dataclasses.replace(
        _resolved(), speculative_algorithm="NGRAM", speculative_num_draft_tokens=4
    )
    with pytest.raises(ValueError, match="n-gram cache shared by all requests"):
        resolve_speculative(ngram, None, None, 512)
