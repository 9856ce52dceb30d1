"""--speculative-adaptive's cost model on the step times of a host-bound engine (a one-layer,
hidden-64 Llama on CPU: docs/benchmarks/adaptive_tiny_cpu.md): it settles on the mode with the
most tokens/s for a useless, an imitating and a perfect draft at batch 1, 16 and 64, its tries of
the other modes stay within their budget, and the fits it keeps between steps are the fits it
would compute afresh."""

from __future__ import annotations

import contextlib
import itertools
import random
import types
from collections.abc import Iterator

import pytest
import torch

from spec_engine import Engine
from spec_engine.speculative import policy as policy_module
from spec_engine.speculative.adaptive import model as model_module
from spec_engine.speculative.adaptive.costs import PLAIN, ModeCost, fitted_seconds
from spec_engine.speculative.adaptive.model import SpecCostModel

# Seconds per request of a decode step, by batch size and mode (0: plain, else the depth of a
# chain: steps 3, topk 1), as a tiny engine measured them on a 2-core VM (rounded): a draft
# model's depth d drafts d times and verifies d + 1 tokens per request.
STEP_S = {
    1: {0: 2.3e-3, 1: 5.0e-3, 2: 6.2e-3, 3: 7.5e-3},
    16: {0: 0.22e-3, 1: 1.6e-3, 2: 2.5e-3, 3: 3.5e-3},
    64: {0: 0.19e-3, 1: 1.5e-3, 2: 2.3e-3, 3: 3.0e-3},
}
# The probability that a request accepts each next draft token.
DRAFTS = {"useless": 0.0, "imitating": 0.75, "perfect": 1.0}
GREEDY_20 = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 20}
STEPS = 600  # a generation of 128 tokens is ~128 steps: about five generations per batch


def expected_rate(mode: int, p: float, batch: int) -> float:
    """Tokens/s per request of `mode`: its expected accept length (1 + p + ... + p^d) over its
    step time."""
    return sum(p**k for k in range(mode + 1)) / STEP_S[batch][mode]


def simulate(p: float, batch: int, seed: int = 0) -> list[int]:
    """The modes the model chooses over STEPS steps whose times are STEP_S's within +-10% and
    whose requests accept each draft token with probability `p`."""
    rng = random.Random(seed)
    model = SpecCostModel([1, 2, 3], nested=True)
    chosen = []
    for _ in range(STEPS):
        mode = model.choose(batch, 0.0)
        chosen.append(mode)
        seconds = batch * STEP_S[batch][mode] * rng.uniform(0.9, 1.1)
        tokens = []
        for _ in range(batch if mode else 0):
            accepted = 0
            while accepted < mode and rng.random() < p:
                accepted += 1
            tokens.append([0] * (accepted + 1))
        model.observe(mode, batch, seconds, tokens)
    return chosen


@pytest.mark.parametrize("batch", sorted(STEP_S))
@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_the_model_settles_on_the_mode_with_the_most_tokens_per_second(draft, batch):
    p = DRAFTS[draft]
    best = max(STEP_S[batch], key=lambda m: expected_rate(m, p, batch))
    chosen = simulate(p, batch)
    settled = chosen[STEPS // 3 :]
    # Plain decoding wins for every draft at batch 16 and 64 and for a useless or imitating one
    # at batch 1 (a depth-3 verify costs 3.3 plain steps there); a perfect draft wins at batch 1.
    assert best == (3 if (draft, batch) == ("perfect", 1) else PLAIN)
    assert max(set(settled), key=settled.count) == best
    # Tries of the other modes: within the exploration budget, a few percent of the steps.
    assert settled.count(best) >= 0.97 * len(settled)
    # The tokens/s of the modes chosen, at their expected accept lengths: at least 0.95 of the
    # best mode's.
    tokens = sum(expected_rate(m, p, batch) * STEP_S[batch][m] for m in settled)
    assert tokens / sum(STEP_S[batch][m] for m in settled) >= 0.95 * expected_rate(best, p, batch)


def test_the_fits_kept_between_steps_are_the_fits_computed_afresh():
    """The model keeps each bucket's fit, its medians and the reference's seconds around each
    measurement between steps (a host-bound step is ~2 ms): a long noisy run, past the
    measurements' history (HISTORY), with slow spells, stale measurements cleared and tries,
    reads at every step what fitted_seconds makes of fresh copies of the same measurements."""
    rng = random.Random(1)
    model = SpecCostModel([1, 2, 3], nested=True)
    for step in range(800):
        mode = model.choose(16, 0.0)
        spell = 1.25 if (step // 50) % 4 == 3 else 1.0  # a slow spell every 200 steps
        stale = 0.5 if 100 <= step < 105 else 1.0  # the measurements before were cold
        seconds = 16 * STEP_S[16][mode] * spell * stale * rng.uniform(0.95, 1.05)
        model.observe(mode, 16, seconds, [[0, 0]] * 16 if mode else ())
        if step % 16 == 0:  # a try now and then, as after a draft got better
            model.costs[16][rng.choice([1, 2, 3])].since = 10**6
        fresh = {
            m: ModeCost(c.history.copy(), c.steps, c.seen, c.since)
            for m, c in model.costs[16].items()
        }
        assert model.seconds(16) == fitted_seconds(fresh), step
    plain = model.costs[16][PLAIN]
    assert len(plain.history) == plain.history.maxlen and plain.steps > plain.history.maxlen


def test_a_settled_choice_holds_without_reading_the_model_and_tries_still_come(monkeypatch):
    """Settled, the model is read once every RECHECK_EVERY steps at most (a host-bound step is
    ~2 ms; reading it every step cost ~5% of the step), and its tries of a losing mode are those
    of a model read every step, each at most a hold or two later (a try's interval moves with
    the fitted costs between reads)."""
    reads = []
    seconds = SpecCostModel.seconds

    def counted(self, batch):
        reads.append(self.clock)
        return seconds(self, batch)

    monkeypatch.setattr(SpecCostModel, "seconds", counted)
    hold = model_module.RECHECK_EVERY
    settled = STEPS // 3
    runs = {}
    for recheck in (1, hold):
        monkeypatch.setattr(model_module, "RECHECK_EVERY", recheck)
        reads.clear()
        chosen = simulate(DRAFTS["useless"], 1)
        tries = [i for i, m in enumerate(chosen) if m != PLAIN and i >= settled]
        runs[recheck] = (tries, sum(c >= settled for c in reads))
    (tries_always, read_always), (tries_held, read_held) = runs[1], runs[hold]
    assert read_always >= STEPS - settled and read_held <= (STEPS - settled) / 8
    assert len(tries_held) == len(tries_always) >= 1
    assert all(0 <= b - a <= 2 * hold for a, b in zip(tries_always, tries_held))


def test_a_held_choice_follows_the_measurements_within_a_hold(monkeypatch):
    """The held mode's steps still feed the model: a perfect draft at batch 1 (depth 3) that
    turns useless at step 300 is left for plain decoding at most RECHECK_EVERY steps after a
    model read every step leaves it, and only then (its accept length must fall first)."""
    switched = {}
    for recheck in (1, model_module.RECHECK_EVERY):
        monkeypatch.setattr(model_module, "RECHECK_EVERY", recheck)
        model = SpecCostModel([1, 2, 3], nested=True)
        chosen = []
        for step in range(400):
            mode = model.choose(1, 0.0)
            chosen.append(mode)
            accepted = mode if step < 300 else 0
            model.observe(mode, 1, STEP_S[1][mode], [[0] * (accepted + 1)] if mode else ())
        assert chosen[250:300] == [3] * 50
        switched[recheck] = next(i for i in range(300, 400) if chosen[i:] == [PLAIN] * (400 - i))
    assert 300 < switched[1] <= switched[model_module.RECHECK_EVERY]
    assert switched[model_module.RECHECK_EVERY] <= switched[1] + model_module.RECHECK_EVERY


def test_one_slow_warm_up_step_does_not_keep_the_best_mode_unchosen():
    """A mode's cost from fewer than three measurements is its fastest: a perfect draft's depth
    3 (the best mode at batch 1) whose last warm-up step ran 20x slow (a load spike on a shared
    VM; a slow step does not clear the ones before it as a fast one does) is chosen from the end
    of the warm-up on, not only after its first retry 128 steps later (the mean of its two
    counted steps would rate it at 10x its cost, and depth 2 would run meanwhile)."""
    model = SpecCostModel([1, 2, 3], nested=True)
    chosen, runs = [], 0
    for _ in range(100):
        mode = model.choose(1, 0.0)
        chosen.append(mode)
        runs += mode == 3
        spike = 20.0 if (mode, runs) == (3, 3) else 1.0  # its first run is not counted
        model.observe(mode, 1, STEP_S[1][mode] * spike, [[0] * (mode + 1)] if mode else ())
    assert chosen[:12].count(3) == 3  # the warm-up: three runs of each mode
    assert chosen[12:] == [3] * 88


def test_a_near_tie_is_worked_out_every_step():
    """A choice holds only while it leads the runner-up by HOLD_MARGIN: a perfect draft at batch
    1 (depth 3 ahead of depth 2 by 10% by STEP_S) is worked out every step, a useless draft's
    plain decoding (ahead of depth 1 2.2x) is held."""
    for p, held in ((1.0, False), (0.0, True)):
        model = SpecCostModel([1, 2, 3], nested=True)
        holds = 0
        for _ in range(200):
            holds += model.held(1) is not None  # before choose: whether it reads the model
            mode = model.choose(1, 0.0)
            tokens = [[0] * (1 + mode * int(p))] if mode else ()
            model.observe(mode, 1, STEP_S[1][mode], tokens)
        assert (holds > 150) == held, (p, holds)


def test_on_cpu_the_model_reads_the_scheduler_threads_cpu_time(make_model, monkeypatch):
    """On a CPU device with one torch thread a step's cost is the scheduler thread's CPU time
    from the policy's `prepare` to its `observe` (a shared machine's wall clock adds the step's
    waits for a core), one reading for every decode step the model observes."""
    ticks = itertools.count(0.0, 1.0)  # a thread clock that advances 1 s per reading
    monkeypatch.setattr(
        policy_module, "time", types.SimpleNamespace(thread_time=lambda: next(ticks))
    )
    seen = []
    observe = SpecCostModel.observe

    def recording(self, mode, batch, seconds, *args, **kwargs):
        seen.append(seconds)
        return observe(self, mode, batch, seconds, *args, **kwargs)

    monkeypatch.setattr(SpecCostModel, "observe", recording)
    target = make_model("llama", num_layers=1, seed=1)
    with (
        one_torch_thread(),
        Engine(
            model_path=target,
            random_seed=0,
            speculative_adaptive=True,
            speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=4,
            disable_cuda_graph=True,
            max_running_requests=2,
            context_length=64,
        ) as engine,
    ):
        engine.generate(input_ids=[[5, 6, 7, 5, 6, 7, 5, 6]] * 2, sampling_params=GREEDY_20)
    assert len(seen) >= 10 and set(seen) == {1.0}


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread while entered (the CPU clock's condition), as it was after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
