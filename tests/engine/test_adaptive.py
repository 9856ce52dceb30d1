"""--speculative-adaptive: per decode step, speculate or decode plainly from the batch size and
a measured cost model (NGRAM); outputs equal plain decoding either way."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_engine import Engine
from spec_engine.args.engine_args import EngineArgs
from spec_engine.args.spec_shapes import candidate_depths, spec_shapes
from spec_engine.launch_server import build_parser
from spec_engine.speculative import draft_lag
from spec_engine.speculative.adaptive.accept_lengths import STEP_SAMPLES
from spec_engine.speculative.adaptive.costs import EXPLORE_EVERY, NOISE, PLAIN, RECENT, bucket
from spec_engine.speculative.adaptive.model import (
    EXPLORE_BUDGET,
    LATEST_STEPS,
    MAX_EXPLORE_EVERY,
    WARM_STEPS,
    SpecCostModel,
)
from spec_engine.speculative.ngram import NgramCache
from specrl.train_options import parse_args
from tests.conftest import random_prompts
from tests.engine.test_adaptive_drafts import verified  # noqa: F401  (fixture)

GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
NGRAM = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)


def repetitive(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a short pattern, so NGRAM drafts get accepted."""
    return [p * 5 for p in random_prompts(count, 4, 8, seed=seed)]


# ------------------------------------------------------------ the cost model alone


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_cost_model_warms_up_every_mode_then_picks_the_fastest_and_explores():
    model = SpecCostModel([1, 2, 3], nested=True)

    def run(batch: int, plain_s: float, spec_s: dict[int, float], steps: int) -> list[int]:
        seen = []
        for _ in range(steps):
            mode = model.choose(batch)
            seen.append(mode)
            seconds = batch * (spec_s[mode] if mode else plain_s)
            model.observe(mode, batch, seconds, [[0] * 4] * batch if mode else ())  # all accepted
        return seen

    # Every draft token accepted (accept(d) = d + 1); at batch 32 a verify of depth d costs
    # 2 + d plain steps per request: (d + 1) / (d + 2) < 1, plain decoding is faster.
    costly = {1: 3.0, 2: 4.0, 3: 5.0}
    warm = run(32, 1.0, costly, 4 * (WARM_STEPS + 1))  # the first step of each is not counted
    assert warm == [3, 0, 2, 1] * (WARM_STEPS + 1)  # round-robin: each mode across the same steps
    assert model.accept_length(2) == pytest.approx(3.0)
    assert model.expected_speculative_gain(32) == pytest.approx(0.8)  # depth 3: 4 / 5
    # Same bucket as 32. No depth could win even with every draft accepted ((d + 1) / cost < 1).
    # Depth 3 (whose steps measure the chain) is tried as a losing mode, at EXPLORE_EVERY and
    # back-off, until its cost rests on RECENT measurements (the warm-up's may be cold), then only
    # after MAX_EXPLORE_EVERY steps; the shallower depths once each, after MAX_EXPLORE_EVERY.
    steps = run(30, 1.0, costly, MAX_EXPLORE_EVERY + 8)
    tries = [i for i, m in enumerate(steps) if m]
    deep = [i for i in tries if steps[i] == 3]
    assert len(deep) == RECENT - WARM_STEPS
    assert [b - a for a, b in zip(deep, deep[1:])] == [1 + 2 * EXPLORE_EVERY, 1 + 4 * EXPLORE_EVERY]
    assert sorted(steps[i] for i in tries if i not in deep) == [1, 2]
    assert min(i for i in tries if i not in deep) >= MAX_EXPLORE_EVERY - len(warm)
    # Batch 1 is measured on its own: there a verify is cheap and the deepest wins.
    run(1, 1.0, {1: 1.1, 2: 1.2, 3: 1.3}, 4 * (WARM_STEPS + 1))
    assert model.choose(1) == 3 and model.choose(20) == 0
    report = model.report()
    assert report["buckets"][1]["depth"] == 3 and report["buckets"][1]["speculate"]
    assert report["buckets"][32]["depth"] == 0 and not report["buckets"][32]["speculate"]
    assert report["plain_steps"] > report["speculative_steps"] > 0
    assert report["steps_by_depth"][3] > 0 and report["accept_length"][3] == pytest.approx(4.0)
    # the latest steps as run: (mode, batch, ms); the last, batch 1's warm-up of depth 1 (1.1 s)
    assert report["latest_steps"][-4:] == [
        (3, 1, 1300.0),
        (0, 1, 1000.0),
        (2, 1, 1200.0),
        (1, 1, 1100.0),
    ]
    assert len(report["latest_steps"]) == LATEST_STEPS


def test_tries_of_a_losing_mode_back_off_and_start_over_with_new_weights():
    """Depth 1 could win if its drafts were accepted (2 / 1.5 > 1) but nothing is: it is tried
    again after E = EXPLORE_EVERY steps, then 2E, 4E, ... (each try a slow step), and after a
    weight update at E again. A try that wins its own step is tried again after E, until the
    averages agree."""
    model = SpecCostModel([1], nested=True)
    e = EXPLORE_EVERY

    def run(steps: int, accepted: int) -> list[int]:
        seen = []
        for _ in range(steps):
            mode = model.choose(8)
            seen.append(mode)
            model.observe(mode, 8, 8 * (1.5 if mode else 1.0), [[0] * (1 + accepted)] * 8)
        return seen

    run(2 * (WARM_STEPS + 1), accepted=0)
    tries = [i for i, m in enumerate(run(e + 2 * e + 4 * e + 8, accepted=0)) if m]
    # (the first interval counts from depth 1's last warm-up step, one plain step before the end
    # of the round-robin warm-up)
    assert tries[0] == e - 1
    assert [b - a for a, b in zip(tries, tries[1:])] == [1 + 2 * e, 1 + 4 * e]
    model.weights_updated()
    assert run(e, accepted=0).count(1) == 1  # tried within E steps again (not 8E)
    # The draft now predicts (2 tokens per 1.5 steps): the next try (2E steps after the last)
    # wins its step, so depth 1 is tried every E steps (not 4E, 8E) until its averages make it
    # the choice (the accept length's average: 1.22, 1.40, 1.53 > 1.5 after three tries).
    later = run(2 * e + 2 * e + 8, accepted=1)
    tries = [i for i, m in enumerate(later) if m][:3]
    assert tries[0] < 2 * e and [b - a for a, b in zip(tries, tries[1:])] == [1 + e, 1 + e]
    assert later[-8:] == [1] * 8 and model.best(8) == 1


def test_a_costly_try_waits_until_its_loss_fits_the_exploration_budget():
    """A verify of random drafts at batch 32 on CPU: 3.6 plain steps per request, no draft
    accepted, yet it could win were every draft accepted (4 / 3.6 > 1), so it is retried. Each try
    loses 2.6 plain steps against plain decoding: the first comes after 2.6 / EXPLORE_BUDGET =
    260 steps, not EXPLORE_EVERY (128), and over a long run the tries cost under the budget."""
    model = SpecCostModel([3], nested=True)

    def run(steps: int) -> list[int]:
        seen = []
        for _ in range(steps):
            mode = model.choose(32)
            seen.append(mode)
            model.observe(mode, 32, 32 * (3.6 if mode else 1.0), [[0]] * 32 if mode else ())
        return seen

    run(2 * (WARM_STEPS + 1))
    steps = run(4000)
    tries = [i for i, m in enumerate(steps) if m]
    # (counted from depth 3's last warm-up step, one plain step before the warm-up's end)
    assert 2.6 / EXPLORE_BUDGET - 1 <= tries[0] + 1 <= 2.6 / EXPLORE_BUDGET + 1
    assert all(b - a > 2.6 / EXPLORE_BUDGET for a, b in zip(tries, tries[1:]))
    assert len(tries) * 2.6 <= EXPLORE_BUDGET * len(steps)
    # A cheap verify (1.5 plain steps: a try loses 0.5) keeps the first interval.
    cheap = SpecCostModel([3], nested=True)
    for _ in range(2 * (WARM_STEPS + 1) + EXPLORE_EVERY):
        mode = cheap.choose(32)
        cheap.observe(mode, 32, 32 * (1.5 if mode else 1.0), [[0]] * 32 if mode else ())
    assert cheap.decisions[3] == WARM_STEPS + 2  # its warm-up steps and one try


def test_a_trys_draft_catch_up_counts_in_its_loss_and_a_trees_depths_share_the_budget():
    """A try of a draft model after a plain stretch first catches its draft up (outside the
    step's time): that catch-up is part of what the try loses. Depth 3 at 1.5 plain steps per
    request, nothing accepted, loses 0.5 a try (EXPLORE_EVERY apart); with 5.0 of catch-up
    before each, 5.5: tries come 5.5 / EXPLORE_BUDGET = 550 steps apart. A tree's three depths,
    each losing 2.6 (a costly verify), share the budget: 3 x 2.6 / EXPLORE_BUDGET = 780 steps
    apart each, not 260."""

    def tries(model: SpecCostModel, spec_s: float, catch_up: float, steps: int) -> list[int]:
        seen, last = [], None
        for _ in range(steps):
            mode = model.choose(32)
            seen.append(mode)
            cost = 32 * (spec_s if mode else 1.0)
            lagging = mode and last == PLAIN
            model.observe(mode, 32, cost, [[0]] * 32 if mode else (), None, 32 * catch_up * lagging)
            last = mode
        return [i for i, m in enumerate(seen) if m]

    # (the first try counts from depth 3's last warm-up step, one plain step before its end)
    warm = 2 * (WARM_STEPS + 1)
    cheap = tries(SpecCostModel([3], nested=True), 1.5, 0.0, warm + 700)[WARM_STEPS + 1]
    assert abs(cheap - (warm + EXPLORE_EVERY)) <= 2
    lagged = tries(SpecCostModel([3], nested=True), 1.5, 5.0, warm + 700)[WARM_STEPS + 1]
    assert abs(lagged - (warm + 5.5 / EXPLORE_BUDGET)) <= 2

    tree = SpecCostModel([1, 2, 3], nested=False)
    steps = tries(tree, 3.6, 0.0, 4 * (WARM_STEPS + 1) + 2500)[3 * (WARM_STEPS + 1) :]
    assert sorted(set(steps)) == steps and len(steps) >= 3  # each depth's tries, in order
    assert min(steps) >= 3 * 2.6 / EXPLORE_BUDGET - 4 * (WARM_STEPS + 1)


def test_a_try_waits_while_the_predicted_catch_up_is_long():
    """The worker's estimate of the catch-up a try would pay now (choose's `catch_up`) stands
    in for the measured switches: depth 3 at 1.5 plain steps per request, nothing accepted,
    with nothing to catch up is tried EXPLORE_EVERY steps after its warm-up; with 5.0 seconds
    per request predicted (a long plain stretch's lag) only after 5.5 / EXPLORE_BUDGET steps;
    and once the lag is gone (a forced catch-up, new requests) at the first interval again."""

    def first_try(predicted: float, steps: int) -> int | None:
        model = SpecCostModel([3], nested=True)
        for step in range(steps):
            warm = model.decisions[3] < WARM_STEPS + 1 or model.decisions[PLAIN] < WARM_STEPS + 1
            mode = model.choose(32, None if warm else 32 * predicted)
            if mode and not warm:
                return step
            model.observe(mode, 32, 32 * (1.5 if mode else 1.0), [[0]] * 32 if mode else ())
        return None

    warm = 2 * (WARM_STEPS + 1)
    assert abs(first_try(0.0, warm + 700) - (warm + EXPLORE_EVERY)) <= 2
    assert abs(first_try(5.0, warm + 700) - (warm + 5.5 / EXPLORE_BUDGET)) <= 2
    assert first_try(5.0, warm + 300) is None


def test_extend_cost_fits_a_fixed_cost_and_a_cost_per_position():
    """Catch-ups of a position or two (the warm-up's) and prefills of hundreds: their fit
    predicts a long lag's catch-up, where the small ones' cost per position (their fixed cost
    spread over few positions) would overcharge it 20-fold."""
    cost = draft_lag.ExtendCost()
    cost.add(32, 0.0050)
    assert cost.predict(4096) is None and cost.predict(0) == 0.0  # one size: not yet known
    for positions in (32, 64, 32):
        cost.add(positions, 0.004 + 1e-5 * positions)
    cost.add(4096, 0.004 + 1e-5 * 4096)  # a prefill
    assert abs(cost.predict(8192) - (0.004 + 1e-5 * 8192)) < 2e-3
    assert cost.predict(8192) < 0.2 * 8192 * 0.005 / 32
    cost.add(8192, 0.004 + 2e-5 * 8192)  # a new sample refits (the fit is kept between them)
    assert cost.predict(8192) > 0.004 + 1.2e-5 * 8192
    flat = draft_lag.ExtendCost()  # timings that fall with size: no negative cost per position
    flat.add(10, 0.02)
    flat.add(1000, 0.01)
    assert flat.predict(10**6) == 0.015


def test_a_chain_tries_only_its_deepest_depth():
    """A chain's shallower depths get their accept lengths from the deepest's steps, so after
    warm-up only the deepest (and plain decoding) are tried again: depths 1 and 2 wait
    MAX_EXPLORE_EVERY steps. A tree's depths are each tried."""
    for nested, tried in ((True, {3}), (False, {1, 2, 3})):
        model = SpecCostModel([1, 2, 3], nested=nested)
        seen = []
        for _ in range(4 * (WARM_STEPS + 1) + 3 * EXPLORE_EVERY):
            mode = model.choose(8)
            seen.append(mode)
            # every depth could win with its drafts accepted (d + 1 > its cost), none is
            model.observe(mode, 8, 8 * (1.0 + 0.1 * mode), [[0]] * 8 if mode else ())
        assert set(seen[4 * (WARM_STEPS + 1) :]) == {0} | tried


def test_expensive_deep_verifies_choose_a_shallower_depth():
    model = SpecCostModel([1, 2, 3], nested=True)
    model.set_accept([0.9, 0.8, 0.7])  # accept lengths 1.9, 2.7, 3.4
    model.set_costs(1, plain_s=1.0, spec_s={1: 1.2, 2: 1.4, 3: 1.6})  # 1.58, 1.93, 2.13 tok/s
    model.set_costs(32, plain_s=1.0, spec_s={1: 1.5, 2: 2.5, 3: 4.0})  # 1.27, 1.08, 0.85
    model.set_costs(128, plain_s=1.0, spec_s={1: 2.5, 2: 3.5, 3: 5.0})  # all below 1
    assert [model.choose(b) for b in (1, 32, 128)] == [3, 1, 0]
    assert model.report()["buckets"][32]["spec_s_per_req"] == {1: 1.5, 2: 2.5, 3: 4.0}


def test_accept_histogram_of_a_chain_sets_every_shallower_depth():
    """Drafts rarely accepted past the first (9 in 10 requests accept exactly one): depth 1
    wins although deeper verifies cost only a little more, and running depth 3 alone measured
    the accept lengths of depths 1 and 2. A tree's (not nested) are measured per depth."""
    chain, tree = SpecCostModel([1, 2, 3], nested=True), SpecCostModel([1, 2, 3], nested=False)
    tokens = [[7, 7]] * 9 + [[7, 7, 7, 7]]  # accepted drafts: 1 nine times, 3 once
    for model in (chain, tree):
        model.observe(3, 10, 10.0, tokens)
    assert [chain.accept_length(d) for d in (1, 2, 3)] == pytest.approx([2.0, 2.1, 2.2])
    assert tree.accept_length(3) == pytest.approx(2.2) and tree.accept_length(1) is None
    chain.set_costs(8, plain_s=1.0, spec_s={1: 1.3, 2: 1.6, 3: 1.9})  # 1.54, 1.31, 1.16 tok/s
    assert chain.choose(8) == 1
    chain.set_accept([1.0, 1.0, 1.0])  # every draft accepted: 2.0 / 1.3 < 4.0 / 1.9
    assert chain.choose(8) == 3


def test_accept_averages_count_requests_not_steps():
    """Each verified request is one sample: the first 32 are averaged plainly (a depth's
    estimate does not rest on one lucky batch-1 step), then each moves the average by 1/32,
    a step of 8 requests by 1 - (31/32)^8."""
    model = SpecCostModel([1, 2], nested=False)
    model.observe(2, 1, 1.0, [[7, 7, 7]])  # one request accepted both drafts
    model.observe(2, 1, 1.0, [[7]])  # one accepted none
    assert model.accept_length(2) == pytest.approx(2.0)  # P(a >= 1) = P(a >= 2) = 1/2
    for _ in range(30):
        model.observe(2, 1, 1.0, [[7, 7]])  # one draft accepted
    p1 = 31 / 32
    assert model.accept.survival[(2, 1)] == pytest.approx(p1)
    assert model.accept.survival[(2, 2)] == pytest.approx(1 / 32)
    model.observe(2, 1, 1.0, [[7]])
    assert model.accept.survival[(2, 1)] == pytest.approx(p1 * (1 - 1 / 32))
    model.observe(2, 8, 1.0, [[7]] * 8)
    assert model.accept.survival[(2, 1)] == pytest.approx(p1 * (1 - 1 / 32) * (31 / 32) ** 8)
    assert model.accept_length(1) is None  # depth 1 of a tree: its own samples only
    before = model.accept.survival[(2, 1)]
    model.observe(2, 64, 1.0, [[7, 7]] * 64)  # one step counts as STEP_SAMPLES requests at most
    weight = 1 - (31 / 32) ** STEP_SAMPLES
    assert model.accept.survival[(2, 1)] == pytest.approx(before + weight * (1 - before))


def test_an_ngram_step_measures_every_smaller_tree_from_its_accepted_paths():
    """An NGRAM tree of d + 1 nodes is the first d + 1 nodes of a larger tree's walk, and node
    indices grow along a path: a step's accepted paths say what each smaller tree would have
    accepted (the path's leading nodes numbered <= d)."""
    model = SpecCostModel([1, 2, 4], nested=False, contained=True)
    # Request A accepted nodes 1, 3, 4 (three drafts), request B nodes 2, 4 (two).
    tokens, paths = [[7] * 4, [7] * 3], [[0, 1, 3, 4], [0, 2, 4]]
    model.observe(4, 2, 1.0, tokens, paths)
    # Depth 1 (nodes 0-1): A 1, B 0. Depth 2 (nodes 0-2): A 1 (node 3 is not in it), B 1.
    assert [model.accept_length(d) for d in (1, 2, 4)] == pytest.approx([1.5, 2.0, 3.5])
    model.observe(1, 2, 1.0, [[7, 7], [7, 7]], [[0, 1], [0, 1]])  # a depth-1 step: depth 1 only
    assert model.accept_length(1) == pytest.approx(1 + 3 / 4)
    assert model.accept_length(2) == pytest.approx(2.0)
    tree = SpecCostModel([1, 2, 4], nested=False)  # a draft model's trees: its own depth only
    tree.observe(4, 2, 1.0, tokens, paths)
    assert tree.accept_length(4) == pytest.approx(3.5) and tree.accept_length(2) is None
    args = EngineArgs(model_path="m", **NGRAM, speculative_adaptive=True)
    assert (
        SpecCostModel.from_args(args).accept.contained and not SpecCostModel.from_args(args).nested
    )


@settings(max_examples=200, deadline=None)
@given(
    text=st.lists(st.integers(0, 5), min_size=2, max_size=200),
    windows=st.tuples(st.integers(1, 3), st.integers(0, 4)),
    breadths=st.tuples(st.integers(1, 3), st.integers(0, 8)),
    nodes=st.tuples(st.integers(1, 8), st.integers(0, 8)),
)
def test_a_smaller_ngram_tree_is_the_start_of_a_larger_one(text, windows, breadths, nodes):
    """What the accepted-path reading above rests on, for the real n-gram cache: a tree of
    fewer nodes is the first nodes of a larger one (tokens and parents)."""
    cache = NgramCache(
        min_window=windows[0],
        max_window=sum(windows),
        min_breadth=breadths[0],
        max_breadth=sum(breadths),
        branch_length=8,
        capacity=10**6,
    )
    cache.insert(None, text)
    small, large = cache.draft(text, nodes[0]), cache.draft(text, sum(nodes))
    assert large.tokens[: small.size] == small.tokens
    assert large.parents[: small.size] == small.parents


def test_a_step_slowed_by_another_process_does_not_move_a_cost():
    """A mode's cost is the median of its last RECENT measurements: one slow step (another
    process on the machine) is ignored, a slowdown that lasts is followed."""
    model = SpecCostModel([1], nested=True)
    for seconds in (9.0, 1.0, 1.1, 10.0):  # the first step is not counted
        model.observe(0, 1, seconds)
    assert model.seconds(1)[0] == pytest.approx(1.1)
    for _ in range(RECENT // 2 + 1):
        model.observe(0, 1, 3.0)
    assert model.seconds(1)[0] == pytest.approx(3.0)


def test_a_slow_spell_of_the_chosen_mode_scales_the_costs_measured_before_it():
    """Run 5's STANDALONE-self at batch 8 (docs/benchmarks/rollout_depth_cpu.md): every draft
    accepted, plain decoding 3.0 per request, depth d 3.75 (d + 1) (a third faster per token).
    The machine slows by 35% after the warm-up: compared as measured, plain steps timed slow lose
    to depths timed fast (1 / 4.05 < 2 / 7.5) and the model leaves plain decoding within three
    steps. Compared as the reference (plain, chosen) ran around their steps, the depths are 35%
    dearer now too, less the first NOISE of it, and plain decoding stays chosen."""
    model = SpecCostModel([1, 2, 3], nested=True)
    cost = {PLAIN: 3.0, 1: 7.5, 2: 11.25, 3: 15.0}

    def run(steps: int, speed: float) -> list[int]:
        seen = []
        for _ in range(steps):
            mode = model.choose(8)
            seen.append(mode)
            tokens = [[0] * (mode + 1)] * 8 if mode else ()
            model.observe(mode, 8, 8 * speed * cost[mode], tokens)
        return seen

    run(4 * (WARM_STEPS + 1) + 30, 1.0)
    assert run(EXPLORE_EVERY // 2, 1.35) == [PLAIN] * (EXPLORE_EVERY // 2)
    now = model.seconds(8)
    assert now[PLAIN] == pytest.approx(4.05)  # the reference: as measured
    assert now[1] == pytest.approx(7.5 * 1.35 / NOISE) and now[3] == pytest.approx(
        15 * 1.35 / NOISE
    )
    # Within NOISE the reference's moves are its steps' noise: nothing is scaled.
    run(RECENT, 1.05 / 1.35)
    assert model.seconds(8)[1] == pytest.approx(7.5)


def test_a_cost_is_compared_with_the_reference_as_measured_nearest_its_steps():
    """The reference is the mode whose RECENT latest measurements are the newest; a measurement
    of another mode is scaled by the reference's median now over its median at the RECENT
    measurements nearest that measurement's step."""
    model = SpecCostModel([2], nested=True)
    plain, deep = model._bucket(1)[PLAIN], model._bucket(1)[2]
    for step, seconds in enumerate([1.0] * 6 + [2.0] * 6):  # plain: 1.0 then 2.0, steps 0-11
        plain.add(seconds, step)
    deep.add(9.0, 0)  # the uncounted first step
    deep.add(3.0, 2)  # measured when plain took 1.0
    assert plain.seconds_at(2) == 1.0 and plain.seconds_at(11) == 2.0
    assert plain.seconds_at(6) == 2.0  # steps 4-8: 1.0, 1.0, 2.0, 2.0, 2.0
    assert model.seconds(1) == pytest.approx({PLAIN: 2.0, 2: 3.0 * 2.0 / NOISE})


def test_on_simulated_machines_the_model_stays_near_the_best_fixed_mode():
    """bench/sim_adaptive.py: per cost set (plain decoding 25% ahead of the best depth to depth
    3 48% ahead) and machine (steady, slow spells, a wave), the model's tokens/s over 768 steps
    stay within 5% of the best fixed mode's on the same machine (item 4's margin), tries and
    warm-up included."""
    from argparse import Namespace

    from bench.sim_adaptive import COSTS, MACHINES, efficiency

    args = Namespace(steps=768, step_noise=0.15)
    shares = {
        (name, machine): min(efficiency(COSTS[name], machine, seed, args) for seed in range(3))
        for name in COSTS
        for machine in MACHINES
    }
    assert min(shares.values()) > 0.95, shares


def test_a_try_much_faster_than_its_cold_warm_up_replaces_those_measurements():
    """The H200 case (8B model, batch 32, every draft accepted): the warm-up measured depth 3 at
    1.51 ms per request where its steady steps take 1.03, so plain decoding (0.342) won: 4 / 1.51
    < 1 / 0.342. The first try after EXPLORE_EVERY steps measures 1.03, which replaces the cold
    measurements (a median over them would still say 1.51): depth 3 is chosen from then on."""
    model = SpecCostModel([1, 2, 3], nested=True)
    cold, steady = {1: 1.147, 2: 1.33, 3: 1.51}, {1: 0.5, 2: 0.75, 3: 1.03}

    def run(steps: int, spec_s: dict[int, float]) -> list[int]:
        seen = []
        for _ in range(steps):
            mode = model.choose(32)
            seen.append(mode)
            seconds = 32 * (spec_s[mode] if mode else 0.342)
            model.observe(mode, 32, seconds, [[0] * (mode + 1)] * 32 if mode else ())
        return seen

    run(4 * (WARM_STEPS + 1), cold)
    assert model.best(32) == 0
    steps = run(EXPLORE_EVERY + 20, steady)
    first = steps.index(3)
    assert first < EXPLORE_EVERY and set(steps[:first]) == {0}
    assert steps[first:] == [3] * len(steps[first:]) and model.best(32) == 3
    assert model.costs[32][3].seconds == pytest.approx(1.03)


def test_costs_are_read_through_their_isotonic_fit():
    """A deeper step never costs less than a shallower one: noisy averages that say so are
    pooled, weighted by their measurements, before the modes are compared."""
    model = SpecCostModel([1, 2, 4], nested=False)
    model.set_accept([0.9, 0.8, 0.7, 0.6])  # accept 1.9, 2.7, 4.0
    model.set_costs(8, plain_s=1.0, spec_s={1: 1.2, 2: 2.4, 4: 1.8})  # depth 2 measured slower
    assert model.seconds(8) == pytest.approx({0: 1.0, 1: 1.2, 2: 2.1, 4: 2.1})
    assert model.best(8) == 4  # 4.0 / 2.1 against depth 2's 2.7 / 2.1 (raw: 2.7 / 2.4, 4.0 / 1.8)
    model.costs[8][4].history.extend([(0, 1.8)] * 3)  # the deeper median rests on four
    assert model.seconds(8)[2] == pytest.approx((2.4 * 1 + 1.8 * 4) / 5)
    model.set_costs(16, plain_s=2.0, spec_s={1: 1.5, 2: 2.5, 4: 3.0})  # plain above depth 1
    assert model.seconds(16) == pytest.approx({0: 1.75, 1: 1.75, 2: 2.5, 4: 3.0})


def test_set_costs_freezes_the_model():
    model = SpecCostModel([1, 2], nested=True)
    model.set_costs(4, plain_s=1.0, spec_s=3.0)
    model.set_accept([1.0])  # accept length 2 at both depths
    assert model.choose(3) == 0
    model.observe(0, 4, 100.0)  # counted as a decision, but does not move the averages
    assert model.report()["buckets"][4]["plain_s_per_req"] == 1.0
    assert model.report()["plain_steps"] == 1
    assert model.choose(1) == 0  # frozen: no warm-up tries; unmeasured means no gain known


def test_bad_depths_and_costs_are_refused_by_value():
    with pytest.raises(ValueError, match=r"ascending and >= 1, got \[2, 1\]"):
        SpecCostModel([2, 1], nested=True)
    with pytest.raises(ValueError, match=r"depths \[4\] are not candidates \(\[1, 2\]\)"):
        SpecCostModel([1, 2], nested=True).set_costs(1, 1.0, {4: 1.0})
    with pytest.raises(ValueError, match=r"in \[0, 1\], got \[1.5\]"):
        SpecCostModel([1], nested=True).set_accept([1.5])
    with pytest.raises(ValueError, match=r"must not grow with k, got \[0.5, 0.9\]"):
        SpecCostModel([1, 2], nested=True).set_accept([0.5, 0.9])
    with pytest.raises(ValueError, match="at least 1, got 0"):
        candidate_depths(0)


def test_candidate_shapes_run_from_the_configured_one_down():
    assert [candidate_depths(n) for n in (1, 3, 4, 5, 8)] == [
        [1],
        [1, 2, 3],
        [1, 2, 4],
        [1, 2, 4, 5],
        [1, 2, 4, 8],
    ]

    def shapes(adaptive: bool, **kwargs) -> list[tuple[int, int, int]]:
        args = EngineArgs(model_path="m", **kwargs)
        return [(s.depth, s.steps, s.draft_tokens) for s in spec_shapes(args, adaptive)]

    tree = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    assert shapes(True, speculative_algorithm="EAGLE", **tree) == [(1, 1, 3), (2, 2, 4), (3, 3, 5)]
    assert shapes(False, speculative_algorithm="EAGLE", **tree) == [(3, 3, 5)]
    wide = dict(speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    assert shapes(True, speculative_algorithm="EAGLE", **wide) == [
        (1, 1, 3),
        (2, 2, 4),
        (4, 4, 7),
        (5, 5, 8),
    ]
    chain = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    assert shapes(True, speculative_algorithm="EAGLE", **chain) == [
        (1, 1, 2),
        (2, 2, 3),
        (3, 3, 4),
    ]
    assert shapes(True, **NGRAM) == [(1, 0, 2), (2, 0, 3), (4, 0, 5), (5, 0, 6)]


# ------------------------------------------------------------ flags


def test_adaptive_needs_an_algorithm_and_takes_any():
    with pytest.raises(ValueError, match="--speculative-adaptive needs --speculative-algorithm"):
        EngineArgs(model_path="m", speculative_adaptive=True)
    for algo in ("EAGLE", "EAGLE3", "STANDALONE", "NEXTN", "ngram"):
        args = EngineArgs(model_path="m", speculative_algorithm=algo, speculative_adaptive=True)
        assert args.speculative_adaptive


def test_flag_on_the_server_and_in_train_py():
    ns = build_parser().parse_args(
        ["--model-path", "m", "--speculative-algorithm", "NGRAM", "--speculative-adaptive"]
    )
    assert ns.speculative_adaptive is True
    args = parse_args(
        [
            "--hf-checkpoint",
            "m",
            "--rollout-batch-size",
            "1",
            "--num-rollout",
            "1",
            "--output-dir",
            "o",
            "--sglang-speculative-algorithm",
            "NGRAM",
            "--sglang-speculative-adaptive",
        ]
    )
    assert args.options.engine.speculative_adaptive is True


# ------------------------------------------------------------ engines


@pytest.fixture(scope="module")
def target(make_model):
    return make_model("llama", num_layers=2, seed=1)


def plain_outputs(path: str, prompts, params) -> list[list[int]]:
    with Engine(model_path=path, random_seed=0) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [o["output_ids"] for o in outs]


def test_speculates_at_batch_1_and_decodes_plainly_at_a_large_batch(target):
    """Costs injected: speculation wins up to batch 2 and loses from 3 on. A batch of 1
    speculates; a batch of 8 never verifies; a batch that shrinks from 4 to 1 (different
    lengths) switches mid-request. Every output equals plain decoding."""
    one, eight = repetitive(1, seed=50), repetitive(8, seed=51)
    shrinking = repetitive(4, seed=52)
    lengths = [{**GREEDY, "max_new_tokens": n} for n in (4, 8, 30, 40)]
    with Engine(model_path=target, random_seed=0, speculative_adaptive=True, **NGRAM) as engine:

        def inject() -> None:
            model = engine.scheduler.policy.adaptive
            model.set_accept([1.0])  # accept length 2 at every depth
            for b in (1, 2):
                model.set_costs(b, plain_s=1.0, spec_s=1.5)  # gain 1.33
            for b in (4, 8, 16):
                model.set_costs(b, plain_s=1.0, spec_s=4.0)  # gain 0.5

        engine._call(inject)
        out_one = engine.generate(input_ids=one, sampling_params=GREEDY)
        out_eight = engine.generate(input_ids=eight, sampling_params=GREEDY)
        out_shrink = engine.generate(input_ids=shrinking, sampling_params=lengths)
        report = engine.get_server_info()["internal_states"][0]["spec_adaptive"]
    assert out_one[0]["meta_info"]["spec_verify_ct"] > 0
    assert out_one[0]["meta_info"]["spec_accept_length"] > 1.0
    assert [o["meta_info"]["spec_verify_ct"] for o in out_eight] == [0] * 8
    verify_cts = [o["meta_info"]["spec_verify_ct"] for o in out_shrink]
    # The first two ran only at batch >= 3 (plain); the others decoded their first tokens plainly
    # beside them, then speculated once the batch was down to 2.
    assert verify_cts[:2] == [0, 0] and verify_cts[2] > 0 and verify_cts[3] > 0
    assert report["speculative_steps"] > 0 and report["plain_steps"] > 0
    assert [o["output_ids"] for o in out_one] == plain_outputs(target, one, GREEDY)
    assert [o["output_ids"] for o in out_eight] == plain_outputs(target, eight, GREEDY)
    assert [o["output_ids"] for o in out_shrink] == plain_outputs(target, shrinking, lengths)


def test_measured_online_outputs_equal_plain_decoding(target):
    """The cost model left to measure (warm-up tries of both modes in every bucket the batch
        passes through, then its own choices): outputs still equal plain decoding, log-probs too; a
    weight update restarts the tries of every mode."""
    prompts = repetitive(6, seed=53)
    params = [{**GREEDY, "max_new_tokens": n} for n in (6, 12, 18, 24, 30, 36)]
    with Engine(model_path=target, random_seed=0, speculative_adaptive=True, **NGRAM) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        report = engine.get_server_info()["internal_states"][0]["spec_adaptive"]
        costs = engine.scheduler.policy.adaptive.costs
        for modes in costs.values():
            for cost in modes.values():
                cost.interval = MAX_EXPLORE_EVERY  # as after many lost tries
        # New weights: every mode's tries start over at the first interval.
        engine.update_weights_from_disk(target, weight_version="v2")
        intervals = {c.interval for modes in costs.values() for c in modes.values()}
    assert intervals == {EXPLORE_EVERY}
    with Engine(model_path=target, random_seed=0) as engine:
        plain = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    assert report["speculative_steps"] > 0 and report["plain_steps"] > 0
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    for o, p in zip(outs, plain):
        got = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _, _ in p["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)


def test_ngram_depth_switching_is_lossless_and_verifies_the_chosen_shape(
    target,
    monkeypatch,
    verified,  # noqa: F811
):
    """NGRAM under a fixed sequence of depths (0: plain), graphs emulated: outputs equal plain
    decoding, every verify's trees stay within the chosen depth's draft tokens, and the verify
    replays the narrowest captured width that holds them, so a shallow step verifies fewer
    rows than the configured shape."""
    pattern = (5, 0, 1, 2, 0, 4, 1)

    def choose(self: SpecCostModel, batch: int, catch_up: float | None = None) -> int:
        return pattern[sum(self.decisions.values()) % len(pattern)]

    monkeypatch.setattr(SpecCostModel, "choose", choose)
    prompts = repetitive(3, seed=54)
    params = [{**GREEDY, "max_new_tokens": n} for n in (20, 30, 40)]
    with Engine(
        model_path=target,
        random_seed=0,
        speculative_adaptive=True,
        cuda_graph_bs=[1, 2, 4],
        **NGRAM,
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        shapes = engine.scheduler.worker.shapes
        widths = [g.width for g in engine.runner.graphs[1:]]  # after the target decode graph
        load = engine.get_load()["loads"][0]["speculative"]
    assert [o["output_ids"] for o in outs] == plain_outputs(target, prompts, params)
    # The server's accept rate: accepted drafts over the most each pass could accept (its depth,
    # not the configured 5).
    passes = [(len(step["trees"]), step["depth"]) for step in verified]
    accepted = sum(o["meta_info"]["spec_accept_token_num"] for o in outs)
    assert load["accept_rate"] == pytest.approx(accepted / sum(n * d for n, d in passes))
    assert load["accept_rate"] > accepted / (5 * sum(n for n, _ in passes))
    assert widths == [2, 3, 5, 6]
    assert {step["depth"] for step in verified} == {1, 2, 4, 5}
    for step in verified:
        shape = shapes[step["depth"]]
        widest = max(size for size, _ in step["trees"])
        assert widest <= shape.draft_tokens
        assert all(depth <= shape.depth for _, depth in step["trees"])
        assert step["graph"] == min(w for w in widths if w >= widest)
    assert any(max(s for s, _ in step["trees"]) == 3 for step in verified if step["depth"] == 2)
