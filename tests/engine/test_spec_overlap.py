"""Overlapped speculative steps (speculative/chain_overlap.py, issue #44 item 4): with
--enable-overlap-schedule a chain step (--speculative-eagle-topk 1) is drafted, verified and
extended before the previous one is read back, and the outputs (tokens, log-probs, accept
lengths, finish reasons) and the KV left cached are those of the synchronous steps: requests
finishing at every step, aborts, pauses and weight changes between two steps."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
from safetensors.torch import load_file, save_file

from bench.host_reads import StepReads
from spec_engine import Engine
from tests.conftest import random_prompts
from tests.engine.test_overlap import ASKED, EVENTS, after_step, count_launches, outputs, report
from tests.engine.test_speculative import small_vocab  # noqa: F401 (a fixture)
from tiny.checkpoints import add_mimo_mtp, build_eagle_draft


def favour_token_3(checkpoint: str) -> None:
    """Scale the head's row of token 3: the target emits it often, drafts guess it often."""
    weights = load_file(os.path.join(checkpoint, "model.safetensors"))
    weights["lm_head.weight"][3] *= 5
    save_file(weights, os.path.join(checkpoint, "model.safetensors"))


@pytest.fixture(scope="module")
def models(small_vocab, make_model, tmp_path_factory):  # noqa: F811
    """test_speculative.py's target of 8 tokens favouring token 3, so that random drafts are
    accepted often and at every length: its EAGLE-2 draft, an EAGLE-3 one, and a MiMo target
    of the same shape (its MTP layer the draft)."""
    target, eagle = small_vocab
    favour_token_3(target)
    root = tmp_path_factory.mktemp("specoverlap")
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    shape = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size")}
    mimo = make_model("qwen2", num_layers=2, initializer_range=0.5, **shape)
    favour_token_3(add_mimo_mtp(mimo, std=0.3))
    small = make_model("llama", num_layers=1, initializer_range=0.5, seed=5, **shape)
    favour_token_3(small)
    return {
        "target": target,
        "eagle3": build_eagle_draft(str(root / "eagle3"), target, version=3, std=0.3),
        "eagle": eagle,
        "mimo": mimo,
        "small": small,
    }


ALGORITHMS = {
    "EAGLE3": ("target", "eagle3"),
    "EAGLE": ("target", "eagle"),
    "MTP": ("mimo", None),
    "STANDALONE": ("target", "small"),
}


def chain(models: dict, algorithm: str = "EAGLE3", **extra) -> dict:
    target, draft = ALGORITHMS[algorithm]
    return dict(
        model_path=models[target],
        speculative_algorithm="EAGLE" if algorithm == "MTP" else algorithm,
        **({"speculative_draft_model_path": models[draft]} if draft else {}),
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        skip_tokenizer_init=True,
        random_seed=3,
        # Batch-invariant kernels: an overlapped step pads its attention to a bound of the
        # lengths (the synchronous one to the lengths), the same values only with these.
        enable_deterministic_inference=True,
        **extra,
    )


def spec_outputs(outs: list[dict]) -> list[tuple]:
    """test_overlap.py's outputs, and each request's verify steps and accept length."""
    return [
        out + (o["meta_info"]["spec_verify_ct"], o["meta_info"]["spec_accept_length"])
        for out, o in zip(outputs(outs), outs)
    ]


def greedy_params(count: int) -> list[dict]:
    """Lengths staggered so that requests finish at every step, some at an EOS (id 2)."""
    return [
        {"temperature": 0.0, "max_new_tokens": 3 + (i * 5) % 13, "ignore_eos": i % 2 == 0}
        for i in range(count)
    ]


def rounds(engine: Engine, batch: int, count: int = 2) -> list:
    """Outputs and memory reports of `batch` requests, then of their conversations extended
    (a later round hits the prefix cache)."""
    prompts, params = random_prompts(batch, 3, 16, seed=batch, vocab=8), greedy_params(batch)
    got = []
    for _ in range(count):
        outs = engine.generate(input_ids=prompts, sampling_params=params, **ASKED)
        got += [spec_outputs(outs), report(engine)]
        prompts = [p + o["output_ids"] + [3, 4] for p, o in zip(prompts, outs)]
    return got


def with_and_without_overlap(
    models: dict, algorithm: str, run: Callable[[Engine], list], prepare=lambda engine: None
) -> list:
    """`run` on an engine without overlap and on one with it (both `prepare`d): equal results
    and every request's KV released; returns the overlapped run's."""
    runs = {}
    for overlap in (False, True):
        with Engine(**chain(models, algorithm), enable_overlap_schedule=overlap) as engine:
            assert engine.scheduler.overlap == overlap
            launches = count_launches(engine)
            prepare(engine)
            runs[overlap] = run(engine)
            assert report(engine)["owned_by_requests"] == 0
            assert (launches[0] > 0) == overlap
    assert runs[True] == runs[False]
    return runs[True]


def test_overlapped_chain_steps_give_the_synchronous_outputs_and_cache(models):
    """EAGLE-3 at batch 1 and 8: equal outputs, accept lengths and memory reports."""
    run = with_and_without_overlap(models, "EAGLE3", lambda e: rounds(e, 1) + rounds(e, 8))
    lengths = {o[6] for o in run[4] + run[6]}
    assert len(lengths) > 3 and max(lengths) > 2  # drafts accepted, at several lengths


@pytest.mark.parametrize("algorithm", ["EAGLE", "MTP", "STANDALONE"])
def test_other_chains_overlap_alike(models, algorithm):
    """EAGLE-2, MTP and STANDALONE (a small LM draft favouring token 3 too) at batch 6."""
    run = with_and_without_overlap(models, algorithm, lambda e: rounds(e, 6, count=1))
    assert max(o[6] for o in run[0]) > 1  # drafts accepted


def test_sampled_chain_steps_overlap_with_the_synchronous_draws(models):
    """Sampled requests (seeded; top-k, top-p, min-p, temperature) mixed with greedy ones: the
    walks' uniforms are picked on the device by what the step in flight emits."""
    prompts = random_prompts(8, 3, 12, seed=9, vocab=8)
    params = [
        {
            "temperature": 0.8 + 0.1 * (i % 3),
            "top_k": 6 if i % 2 else -1,
            "top_p": 0.9,
            "min_p": 0.02 * (i % 2),
            "max_new_tokens": 6 + (i * 5) % 11,
            "ignore_eos": True,
        }
        if i % 4
        else {"temperature": 0.0, "max_new_tokens": 9}
        for i in range(8)
    ]

    def run(engine: Engine) -> list:
        return spec_outputs(engine.generate(input_ids=prompts, sampling_params=params, **ASKED))

    got = with_and_without_overlap(models, "EAGLE3", run)
    assert max(o[6] for o in got) > 1.5


@pytest.mark.parametrize("event", ["abort", "weights"])
def test_commands_between_overlapped_chain_steps_see_the_synchronous_state(models, event):
    """An abort or a weight change (test_overlap.py's events) lands right after the 3rd step, on
    the scheduler thread, as a command posted then would: the step in flight is read first."""
    prompts = random_prompts(4, 3, 12, seed=4, vocab=8)
    params = [{**p, "max_new_tokens": 12} for p in greedy_params(4)]
    rids = [f"r{i}" for i in range(4)]

    def run(engine: Engine) -> list:
        outs = engine.generate(input_ids=prompts, sampling_params=params, rid=rids, **ASKED)
        return spec_outputs(outs)

    got = with_and_without_overlap(
        models, "EAGLE3", run, lambda engine: after_step(engine, 3, EVENTS[event])
    )
    assert any(o[4]["type"] == "abort" for o in got) == (event == "abort")


def test_an_overlapped_chain_step_reads_once(models):
    """One read per overlapped step, greedy and sampled requests alike (the step in flight's
    tokens, accept lengths, flags and log-probs: within test_host_reads.py's budget), none in
    the first (nothing in flight), two in the last (the step in flight, of finished requests
    only, read at once); requests with penalties take the synchronous steps."""
    with Engine(**chain(models), enable_overlap_schedule=True) as engine:
        params = [
            {"temperature": 0.9 * (i % 2), "max_new_tokens": 16, "ignore_eos": True}
            for i in range(8)
        ]
        prompts = random_prompts(8, 3, 12, seed=6, vocab=8)
        with StepReads(engine) as steps:
            engine.generate(input_ids=prompts, sampling_params=params, **ASKED)
        reads = [s.reads for s in steps.decode_steps("spec")]
        assert len(reads) > 3 and reads == [0] + [1] * (len(reads) - 2) + [2]
        launches = count_launches(engine)
        penalised = {"frequency_penalty": 0.5, "max_new_tokens": 8, "ignore_eos": True}
        engine.generate(input_ids=prompts[:2], sampling_params=penalised)
        assert launches[0] == 0
