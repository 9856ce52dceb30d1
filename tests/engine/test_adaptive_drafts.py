"""--speculative-adaptive with draft-model algorithms (EAGLE tree, EAGLE-3, MTP, STANDALONE):
plain steps run no draft, and the next speculative step catches the draft's KV and next-round
state up (speculative/draft_lag.py), so switching per step is lossless and the draft drafts
after a plain stretch as well as it would have without one."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

from spec_engine import Engine
from spec_engine.core.scheduler import Scheduler
from spec_engine.forward_batch import ForwardMode
from spec_engine.runner.graph_runner import GraphRunner
from spec_engine.speculative import draft_lag
from spec_engine.speculative.adaptive.model import SpecCostModel
from spec_engine.speculative.base import SpecWorker
from spec_engine.speculative.draft_runner import DraftRunner
from spec_engine.speculative.eagle_worker import EagleWorker
from spec_engine.speculative.tree import host_trees
from tests.conftest import random_prompts
from tiny.checkpoints import add_mimo_mtp, build_checkpoint, build_eagle_draft

GREEDY = {"temperature": 0.0, "ignore_eos": True}
# The depth of each decode step (0: plain), by the step's index: plain stretches of 1, 2 and 6
# steps, speculative ones at every depth (capped at the configured one) and changing depth.
PATTERN = (3, 0, 1, 0, 0, 2, 3, 1, 2) + (0,) * 6


@pytest.fixture
def alternating(monkeypatch):
    """The cost model replaced by PATTERN; a pure function of the steps run, as the scheduler
    asks it again within a step after a retraction."""

    def choose(self: SpecCostModel, batch: int, catch_up: float | None = None) -> int:
        depth = PATTERN[sum(self.decisions.values()) % len(PATTERN)]
        return min(depth, self.depths[-1])

    monkeypatch.setattr(SpecCostModel, "choose", choose)


@pytest.fixture
def verified(monkeypatch):
    """Per speculative step, the depth chosen, the verified trees' (sizes, depths), the drafts
    each request accepted and the width of the verify graph that replayed it (None: eager)."""
    seen: list = []
    observe, verify, run = SpecCostModel.observe, SpecWorker.verify, GraphRunner.run

    verifying: list = []  # the step whose verify is running (not the startup self-check's)

    def record_tree(self, reqs, trees, on_host=None):
        kept = host_trees(trees)  # the trees live on the device: read here, for the record
        seen.append({"trees": [(t.size, max(t.depths)) for t in kept], "graph": None})
        verifying.append(seen[-1])
        try:
            return verify(self, reqs, trees, on_host)
        finally:
            verifying.clear()

    def record_graph(self, batch, *args, **kwargs):
        out = run(self, batch, *args, **kwargs)
        if batch.mode is ForwardMode.TARGET_VERIFY and out is not None and verifying:
            verifying[0]["graph"] = self.width
        return out

    def record_depth(self, mode, batch, seconds, tokens=(), paths=None, catch_up=0.0):
        if mode:
            seen[-1].update(depth=mode, accepted=[len(t) - 1 for t in tokens])
        return observe(self, mode, batch, seconds, tokens, paths, catch_up)

    monkeypatch.setattr(SpecWorker, "verify", record_tree)
    monkeypatch.setattr(GraphRunner, "run", record_graph)
    monkeypatch.setattr(SpecCostModel, "observe", record_depth)
    return seen


@pytest.fixture(scope="module")
def models(make_model, tmp_path_factory):
    target = make_model("llama", num_layers=2, seed=3)
    root = tmp_path_factory.mktemp("adaptive_drafts")
    copy = str(root / "target_copy")  # the target as a draft with its own weights and KV
    shutil.copytree(target, copy)
    return {
        "target": target,
        "eagle": build_eagle_draft(str(root / "eagle"), target, version=2),
        "eagle3": build_eagle_draft(str(root / "eagle3"), target, version=3, draft_vocab_size=128),
        "small": build_checkpoint(str(root / "small"), arch="llama", num_layers=1, seed=5),
        "copy": copy,
        "mimo": add_mimo_mtp(make_model("qwen2", num_layers=2, seed=7)),
    }


TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
CONFIGS = {
    "eagle-tree": ("target", dict(speculative_algorithm="EAGLE", draft="eagle", **TREE)),
    "eagle3": ("target", dict(speculative_algorithm="EAGLE3", draft="eagle3", **TREE)),
    "mtp": ("mimo", dict(speculative_algorithm="EAGLE", speculative_num_steps=2)),
    "standalone": ("target", dict(speculative_algorithm="STANDALONE", draft="small", **TREE)),
}


def engine_args(models, name: str) -> tuple[str, dict]:
    target, kwargs = CONFIGS[name]
    kwargs = dict(kwargs)
    draft = kwargs.pop("draft", None)
    if draft is not None:
        kwargs["speculative_draft_model_path"] = models[draft]
    return models[target], kwargs


def draft_kv(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """The draft's K/V at every cached position of `tokens` (a copy), read on the scheduler
    thread."""

    def read() -> torch.Tensor:
        slots, _ = engine.scheduler.kv.tree_cache.match_prefix(tokens)
        pool = engine.scheduler.worker.draft.kv_pool
        return torch.stack([buf[slots].float().clone() for buf in pool.buffers()])

    return engine._call(read)


@pytest.fixture
def spied(monkeypatch):
    """Draft forwards counted per plain step (none: it records what the draft needs) and per
    catch-up before a plain step, with whether a request's lag had reached MAX_LAG (5:
    PATTERN's six-step stretches reach it, and its catch-ups are wider than the captured draft
    extend, so they run eagerly, the shorter ones replay it); the longest lag a plain step
    started from; every request that decoded plainly; and one retraction of the running
    requests as soon as one of them lags two positions."""
    for bound in ("MIN_LAG", "MAX_LAG"):
        monkeypatch.setattr(draft_lag, bound, 5)
    seen: dict = {"forwards": 0, "plain": [], "full": [], "lag": 0, "reqs": {}, "retracted": []}
    forward, decode_plain, step = DraftRunner.forward, EagleWorker.decode_plain, Scheduler.step
    catch_up = EagleWorker.catch_up

    def count(self, *args, **kwargs):
        seen["forwards"] += 1
        return forward(self, *args, **kwargs)

    def plain(self, reqs):
        lags = [len(r.draft_lag.tokens) for r in reqs if r.draft_lag]
        seen["lag"] = max([seen["lag"], *lags])
        before = seen["forwards"]
        result = decode_plain(self, reqs)
        seen["plain"].append(seen["forwards"] - before)
        seen["reqs"].update((id(r), r) for r in reqs)
        return result

    def catch(self, reqs, full_only=False):
        full = any(r.draft_lag and len(r.draft_lag.tokens) == draft_lag.MAX_LAG for r in reqs)
        before = seen["forwards"]
        catch_up(self, reqs, full_only)
        if full_only:
            seen["full"].append((full, seen["forwards"] - before))

    def retract_once(self):
        step(self)
        lagging = [r for r in self.running if r.draft_lag and len(r.draft_lag.tokens) >= 2]
        if lagging and not seen["retracted"]:
            seen["retracted"] = list(self.running)
            self.retract_all()

    monkeypatch.setattr(DraftRunner, "forward", count)
    monkeypatch.setattr(EagleWorker, "decode_plain", plain)
    monkeypatch.setattr(EagleWorker, "catch_up", catch)
    monkeypatch.setattr(Scheduler, "step", retract_once)
    return seen


def test_lag_limit_holds_the_feature_budget_within_its_bounds():
    """How far a draft may lag before it catches up: its share of the 256 MiB of feature rows
    when every running request lags, within [128, 1024] positions; token-only drafts 1024."""
    rows = lambda dim, dtype: torch.zeros(2, dim, dtype=dtype, device="cpu")  # noqa: E731
    assert draft_lag.lag_limit(None, 256) == 1024
    # An 8B EAGLE-3 draft's rows (3 x 4096 bfloat16, 24 KiB) for 256 requests: the floor.
    assert draft_lag.lag_limit(rows(3 * 4096, torch.bfloat16), 256) == 128
    assert draft_lag.lag_limit(rows(4096, torch.float32), 64) == 256  # 256 MiB / (64 x 16 KiB)
    assert draft_lag.lag_limit(rows(3 * 512, torch.float32), 32) == 1024  # capped


@pytest.mark.parametrize("name", list(CONFIGS))
def test_switching_every_few_steps_is_lossless_and_keeps_the_draft_in_step(
    models, name, alternating, spied, verified
):
    """Requests of different prompt lengths, the later ones joining mid-run, under PATTERN,
    the first ones retracted once while their draft lags: greedy outputs equal the target
    alone's, and so does a continuation served from the prefix cache the run filled. A plain
    step never runs the draft: it catches up before, untimed, only once a request's lag reaches
    MAX_LAG; no request keeps a record
    after its release. Afterwards the draft KV the run left for a finished request (positions
    decoded plainly included; those its draft still lagged at when it finished stay out of the
    prefix cache) equals what a prefill of its whole sequence computes: a speculative step that
    did not catch the draft up would have left those slots stale. Every speculative step
    verified the shape of the depth chosen for it (steps and draft tokens), on the verify graph
    of that width."""
    path, kwargs = engine_args(models, name)
    first, later = random_prompts(3, 3, 30, seed=61), random_prompts(3, 8, 40, seed=62)
    params = [{**GREEDY, "max_new_tokens": n} for n in (20, 28, 36)]
    more = {**GREEDY, "max_new_tokens": 12}
    with Engine(model_path=path, random_seed=0) as engine:
        outs = engine.generate(input_ids=first + later, sampling_params=params * 2)
        want = [o["output_ids"] for o in outs]
        # A continuation of a finished request: under adaptive it hits the prefix cache.
        sequence = first[2] + want[2]
        want_more = engine.generate(input_ids=sequence, sampling_params=more)["output_ids"]
    results: dict = {}
    with Engine(model_path=path, random_seed=0, speculative_adaptive=True, **kwargs) as engine:
        t = threading.Thread(
            target=lambda: results.setdefault(
                "first", engine.generate(input_ids=first, sampling_params=params)
            )
        )
        t.start()
        deadline = time.time() + 60
        while not engine.scheduler.running and time.time() < deadline:
            time.sleep(0.001)
        results["later"] = engine.generate(input_ids=later, sampling_params=params)
        t.join()
        report = engine.get_server_info()["internal_states"][0]["spec_adaptive"]
        shapes = engine.scheduler.worker.shapes
        left = draft_kv(engine, sequence)
        cont = engine.generate(input_ids=sequence, sampling_params=more)
        assert engine.flush_cache()
        engine.generate(input_ids=sequence, sampling_params={**GREEDY, "max_new_tokens": 1})
        fresh = draft_kv(engine, sequence)
    outs = [o["output_ids"] for o in results["first"] + results["later"]]
    assert outs == want
    assert cont["output_ids"] == want_more and cont["meta_info"]["cached_tokens"] > 0
    assert report["speculative_steps"] > 0 and report["plain_steps"] > 0
    n = min(left.shape[1], fresh.shape[1])
    assert n > len(first[2]) + 10  # the comparison covers decoded positions
    torch.testing.assert_close(left[:, :n], fresh[:, :n], atol=1e-4, rtol=1e-4)
    assert spied["retracted"] and all(r.draft_lag is None for r in spied["reqs"].values())
    assert {step["depth"] for step in verified} == set(shapes) and len(shapes) > 1
    for step in verified:
        shape = shapes[step["depth"]]
        assert all(
            size == shape.draft_tokens and depth <= shape.depth for size, depth in step["trees"]
        )
        assert step["graph"] == shape.draft_tokens
    # A plain step never runs the draft; before one, only a lag of MAX_LAG is caught up.
    assert spied["plain"] and not any(spied["plain"]) and spied["lag"] < draft_lag.MAX_LAG
    full = spied["full"]
    assert any(f for f, _ in full) and any(not f for f, _ in full)
    assert all((forwards > 0) == f for f, forwards in full)


def test_the_scheduler_charges_a_try_the_catch_up_the_worker_predicts(
    models, alternating, monkeypatch
):
    """choose() gets the worker's estimate of the catch-up a speculative step would pay now:
    0 right after a speculative step, growing along a plain stretch with the positions the
    requests lag (each step's estimate from one fit of the draft's prefill extends and
    catch-ups, which every prefill and catch-up feeds). The extends' measured seconds are
    replaced by a cost that grows with their positions, as they do on an idle machine: a
    loaded one can time a one-position catch-up slower than a prefill, which the fit reads as
    no cost per position. The scheduler asks once per step (each ask fits the cost model)."""
    asked: list = []
    pattern_choose = SpecCostModel.choose

    def recording(self, batch, catch_up=None):
        asked.append((sum(self.decisions.values()), catch_up))
        return pattern_choose(self, batch, catch_up)

    monkeypatch.setattr(SpecCostModel, "choose", recording)
    path, kwargs = engine_args(models, "mtp")
    prompts = random_prompts(3, 4, 12, seed=64)
    with Engine(model_path=path, random_seed=0, speculative_adaptive=True, **kwargs) as engine:
        cost = engine.scheduler.worker.extend_cost
        measured = cost.add
        monkeypatch.setattr(cost, "add", lambda n, seconds: measured(n, 1e-3 + 1e-4 * n))
        cost.samples.clear()  # any measured at start-up
        engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 40})
        samples = list(cost.samples)
    steps = [step for step, _ in asked]
    assert len(steps) == len(set(steps)), "one choice per decode step (no retraction here)"
    per_step = dict(asked)
    known = [(step, s) for step, s in per_step.items() if s is not None]
    assert len(known) > 20
    after_spec = [s for step, s in known if PATTERN[(step - 1) % len(PATTERN)] != 0]
    assert after_spec and all(s == 0.0 for s in after_spec)
    # PATTERN's closing stretch of six plain steps: the estimate grows step by step.
    stretch = [dict(known).get(step) for step in range(10, 16)]
    assert None not in stretch and 0 < stretch[1] < stretch[-1], stretch
    assert all(a <= b for a, b in zip(stretch, stretch[1:])), stretch
    sizes = {positions for positions, _ in samples}
    assert max(sizes) >= 12 and min(sizes) <= 3 * len(prompts)  # prefills and catch-ups


def test_a_draft_that_predicts_well_accepts_as_much_after_a_plain_stretch(
    models, alternating, verified
):
    """The target's copy as a STANDALONE draft (its own weights and KV, unlike a self-draft)
    predicts every greedy token: each verify round accepts all of its steps, whatever its
    depth, plain stretches or not. A draft whose KV missed the plainly decoded tokens would
    mispredict after them. The acceptance alarm measures the configured depth's verifies
    only."""
    steps = 3
    prompts = random_prompts(4, 5, 30, seed=63)
    params = [{**GREEDY, "max_new_tokens": n} for n in (24, 30, 36, 40)]
    with Engine(
        model_path=models["target"],
        random_seed=0,
        speculative_adaptive=True,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=models["copy"],
        speculative_num_steps=steps,
        speculative_eagle_topk=1,
    ) as engine:
        assert not engine.scheduler.worker.draft.shares_target
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        report = engine.get_server_info()["internal_states"][0]["spec_adaptive"]
        alarm = engine.scheduler.policy.alarm.current
    assert report["speculative_steps"] > 0 and report["plain_steps"] > 0
    assert all(out["meta_info"]["spec_verify_ct"] > 0 for out in outs)
    assert {step["depth"] for step in verified} == {1, 2, steps}
    assert all(a == step["depth"] for step in verified for a in step["accepted"])
    # The acceptance alarm saw only the configured depth's verifies (a shallower one's accept
    # length would read as a collapse): all accepted, though a request's last may be cut.
    deepest = [a for step in verified if step["depth"] == steps for a in step["accepted"]]
    assert alarm.verify_ct == len(deepest) and alarm.emitted > 0.9 * (steps + 1) * len(deepest)
