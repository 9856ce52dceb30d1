"""The overlap scheduler (core/overlap.py, issue #44 item 4), on by default for plain decoding as
in SGLang: decode step N+1 is launched before step N is read back, and the outputs (tokens,
log-probs, finish reasons) and the KV left cached are those of the step-by-step scheduler
(--disable-overlap-schedule): greedy, sampled with seeds and min_new_tokens, stop ids, requests
that must sample step by step (penalties), under retraction, and with aborts, pauses and weight
changes landing between two steps."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from bench.host_reads import HostReads
from spec_engine import Engine
from spec_engine.engine_loop import Command
from tests.conftest import random_prompts

ASKED = dict(return_logprob=True, top_logprobs_num=2, token_ids_logprob=[3, 7])
OFF = {"disable_overlap_schedule": True}


def mixed_params(count: int) -> list[dict]:
    """Greedy, sampled (top-k, top-p, min_new_tokens, stop ids) and, every fifth, a penalised
    request, which samples step by step (no step overlaps while it runs); lengths staggered so
    requests finish at every step."""
    params = []
    for i in range(count):
        p: dict = {"max_new_tokens": 3 + (i * 5) % 11}
        if i % 3 == 0:
            p["temperature"] = 0.0
        else:
            p.update(temperature=0.9, top_k=20 if i % 2 else -1, top_p=0.9, min_new_tokens=2)
            p["stop_token_ids"] = [i * 31 % 512]
        if i % 5 == 4:  # short, so that the others overlap soon after
            p.update(frequency_penalty=0.5, max_new_tokens=2)
        params.append(p)
    return params


def outputs(outs: list[dict]) -> list[tuple]:
    return [
        (
            o["output_ids"],
            o["meta_info"]["output_token_logprobs"],
            o["meta_info"]["output_top_logprobs"],
            o["meta_info"]["output_token_ids_logprobs"],
            o["meta_info"]["finish_reason"],
        )
        for o in outs
    ]


def overlapping(overlap: bool) -> dict:
    """Engine options: the default (overlap), or SGLang's flag turning it off."""
    return {} if overlap else OFF


def report(engine: Engine) -> dict[str, int]:
    """Where the KV is, read on the scheduler thread between steps (as /v1/loads reads it)."""
    return engine._call(engine.scheduler.memory_report)


def count_launches(engine: Engine) -> list[int]:
    """A counter of the overlapped launches the engine's worker makes."""
    launches = [0]
    launch = engine.scheduler.worker.launch_decode

    def counted(*args, **kwargs):
        launches[0] += 1
        return launch(*args, **kwargs)

    engine.scheduler.worker.launch_decode = counted
    return launches


@pytest.fixture(scope="module")
def model(make_model) -> str:
    return make_model("llama", num_layers=1)


def test_overlapped_steps_give_the_step_by_step_outputs_and_cache(model):
    """Two rounds (the second extends the first's conversations, hitting the prefix cache) at
    batch 1 and 16: equal outputs, equal memory reports after each round."""
    runs = {}
    for overlap in (False, True):
        with Engine(model_path=model, random_seed=3, **overlapping(overlap)) as engine:
            launches = count_launches(engine)
            got = []
            for batch in (1, 16):
                prompts = random_prompts(batch, 3, 20, seed=batch)
                params = mixed_params(batch)
                first = engine.generate(input_ids=prompts, sampling_params=params, **ASKED)
                got += [outputs(first), report(engine)]
                again = [p + o["output_ids"] + [9, 10] for p, o in zip(prompts, first)]
                second = engine.generate(input_ids=again, sampling_params=params, **ASKED)
                got += [outputs(second), report(engine)]
            assert report(engine)["owned_by_requests"] == 0
            runs[overlap] = got
            assert (launches[0] > 0) == overlap
    assert runs[True] == runs[False]


def timeline(engine: Engine) -> list[str]:
    """The engine's decode steps in order: "launch" when an overlapped step is launched, "read"
    when one is read back, "step" for a step-by-step decode (launched and read at once)."""
    events: list[str] = []
    worker = engine.scheduler.worker
    launch, decode = worker.launch_decode, worker.decode

    def launched(*args, **kwargs):
        events.append("launch")
        pending = launch(*args, **kwargs)
        finish = pending.finish
        pending.finish = lambda: events.append("read") or finish()
        return pending

    def decoded(*args, **kwargs):
        events.append("step")
        return decode(*args, **kwargs)

    worker.launch_decode, worker.decode = launched, decoded
    return events


@pytest.mark.parametrize(
    "options",
    [{}, {"disable_overlap_schedule": True}, {"enable_overlap_schedule": True, **OFF}],
    ids=["default", "disabled", "both"],
)
def test_the_default_engine_overlaps_and_the_sglang_flag_stops_it(model, options):
    """By default each plain decode step is launched before the one in flight is read back
    (the last one, launched while the requests finish, is read at the next drain); SGLang's
    --disable-overlap-schedule steps one at a time, and wins over --enable-overlap-schedule.
    get_server_info reports the flags as the engine runs them."""
    with Engine(model_path=model, random_seed=0, **options) as engine:
        events = timeline(engine)
        engine.generate(
            input_ids=[[5, 6, 7], [8, 9]],
            sampling_params={"max_new_tokens": 4, "ignore_eos": True},
        )
        info = engine.get_server_info()
    on = not options
    assert engine.scheduler.overlap is on
    assert (info["enable_overlap_schedule"], info["disable_overlap_schedule"]) == (on, not on)
    # Tokens 2..4 come from three decode steps (the prefill samples the first).
    want = ["launch", "launch", "read", "launch", "read", "launch", "read", "read"]
    assert events == (want if on else ["step"] * 3)


def test_overlap_under_retraction_gives_the_step_by_step_outputs(model):
    prompts = random_prompts(12, 10, 30, seed=12)
    params = [
        {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 36 + i % 4, "ignore_eos": True}
        for i in range(12)
    ]
    runs = {}
    for overlap in (False, True):
        with Engine(
            model_path=model, random_seed=5, max_total_tokens=200, **overlapping(overlap)
        ) as engine:
            launches = count_launches(engine)
            runs[overlap] = outputs(
                engine.generate(input_ids=prompts, sampling_params=params, **ASKED)
            )
            assert engine.scheduler.retraction.num_retractions > 0
            assert (launches[0] > 0) == overlap
    assert runs[True] == runs[False]


def _scale_head(engine: Engine) -> None:
    """A weight change, made on the scheduler thread between steps as an update makes it."""
    with torch.no_grad():
        engine.runner.model.lm_head.weight.mul_(1.5)
    engine.scheduler.weights_changed(flush=True)


EVENTS = {
    "abort": lambda e: [
        Command("scheduler.abort", ("r1", None)),
        Command("scheduler.abort", ("r4", None)),
    ],
    "pause-retract": lambda e: [
        Command("memory.pause", ("retract",)),
        Command("_continue_generation", (False,)),
    ],
    "pause-abort": lambda e: [Command("memory.pause", ("abort",))],
    "weights": lambda e: [
        Command("memory.pause", ("in_place",)),
        lambda: _scale_head(e),
        Command("_continue_generation", (False,)),
    ],
}


def after_step(engine: Engine, k: int, event: Callable[[Engine], list]) -> None:
    """Run `event`'s commands on the scheduler thread right after its k-th step, as commands
    posted during that step would run."""
    scheduler, step, steps = engine.scheduler, engine.scheduler.step, [0]

    def stepped() -> None:
        step()
        steps[0] += 1
        if steps[0] == k:
            engine._run_commands([(c, None) for c in event(engine)])

    scheduler.step = stepped


@pytest.mark.parametrize("event", list(EVENTS))
def test_commands_between_overlapped_steps_see_the_step_by_step_state(model, event):
    """The event lands right after the 4th step, on the scheduler thread, as a command posted
    then would: with overlap the step in flight is read and processed first."""
    prompts = random_prompts(6, 3, 12, seed=4)
    params = [{**p, "max_new_tokens": 12, "frequency_penalty": 0.0} for p in mixed_params(6)]
    runs = {}
    for overlap in (False, True):
        with Engine(model_path=model, random_seed=2, **overlapping(overlap)) as engine:
            after_step(engine, 4, EVENTS[event])
            outs = engine.generate(
                input_ids=prompts,
                sampling_params=params,
                rid=[f"r{i}" for i in range(6)],
                **ASKED,
            )
            runs[overlap] = (outputs(outs), report(engine))
            assert runs[overlap][1]["owned_by_requests"] == 0
    assert runs[True] == runs[False]
    assert any(o[4]["type"] == "abort" for o in runs[True][0]) == ("abort" in event)


def test_an_overlapped_step_reads_once_and_after_launching_the_next(model):
    """Each step that launches a decode reads the host nothing before the launch and then once
    (the step in flight's tokens, log-probs and flags: core/readback.py)."""
    with Engine(model_path=model, random_seed=1) as engine:
        reads = HostReads(engine._thread.ident)
        sched, worker = engine.scheduler, engine.scheduler.worker
        step, launch = sched.step, worker.launch_decode
        seen: dict[str, int] = {}
        records: list[tuple[int, int]] = []

        def launched(*args, **kwargs):
            seen["before"] = reads.count - seen["start"]
            return launch(*args, **kwargs)

        def stepped() -> None:
            seen.clear()
            seen["start"] = reads.count
            step()
            if "before" in seen:
                records.append((seen["before"], reads.count - seen["start"]))

        sched.step, worker.launch_decode = stepped, launched
        sampled = {"temperature": 0.9, "top_k": 20, "max_new_tokens": 6, "ignore_eos": True}
        with reads:
            engine.generate(
                input_ids=random_prompts(8, 3, 12, seed=6), sampling_params=sampled, **ASKED
            )
    assert len(records) == 6  # one launch per token after the prefill's, and one more
    assert [before for before, _ in records] == [0] * 6
    # The last: the requests finish; the step in flight, theirs alone, has its KV released at
    # once (their callers find it released) and is read at the next drain, a step of its own.
    assert [total for _, total in records] == [0, 1, 1, 1, 1, 1]


def test_overlapped_streams_deliver_the_step_by_step_chunks(model):
    """Streaming every second token: the same chunks (ids, log-probs), one step later."""
    prompt = random_prompts(1, 3, 12, seed=8)[0]
    sampled = {"temperature": 0.9, "top_k": 20, "max_new_tokens": 9, "ignore_eos": True}
    runs = {}
    for overlap in (False, True):
        with Engine(
            model_path=model, random_seed=4, stream_interval=2, **overlapping(overlap)
        ) as engine:
            launches = count_launches(engine)
            chunks = engine.generate(
                input_ids=prompt, sampling_params=sampled, stream=True, return_logprob=True
            )
            runs[overlap] = [
                (c["output_ids"], c["meta_info"]["output_token_logprobs"]) for c in chunks
            ]
            assert (launches[0] > 0) == overlap
    assert len(runs[True]) == 5
    assert runs[True] == runs[False]
