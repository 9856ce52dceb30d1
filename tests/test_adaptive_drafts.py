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
from spec_engine.core.adaptive import SpecCostModel
from spec_engine.core.scheduler import Scheduler
from spec_engine.speculative import draft_lag
from spec_engine.speculative.draft_runner import DraftRunner
from spec_engine.speculative.eagle_worker import EagleWorker
from specrl.tiny_models import add_mimo_mtp, build_checkpoint, build_eagle_draft
from tests.conftest import random_prompts

GREEDY = {"temperature": 0.0, "ignore_eos": True}
# Speculate or not per decode step, by the step's index: plain stretches of 1, 2 and 6 steps.
PATTERN = (True, False, True, False, False, True, True) + (False,) * 6


@pytest.fixture
def alternating(monkeypatch):
    """The cost model replaced by PATTERN; a pure function of the steps run, as the scheduler
    asks it several times per step."""

    def speculate(self: SpecCostModel, batch: int) -> bool:
        return PATTERN[sum(self.decisions.values()) % len(PATTERN)]

    monkeypatch.setattr(SpecCostModel, "speculate", speculate)


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
        slots, _ = engine.scheduler.tree_cache.match_prefix(tokens)
        pool = engine.scheduler.worker.draft.kv_pool
        return torch.stack([buf[slots].float().clone() for buf in pool.buffers()])

    return engine._call(read)


@pytest.fixture
def spied(monkeypatch):
    """Draft forwards counted per plain step, with whether a request's lag reached MAX_LAG in
    it (5: PATTERN's six-step stretches reach it, and its catch-ups are wider than the captured
    draft extend, so they run eagerly, the shorter ones replay it); every request that decoded
    plainly; and one retraction of the running requests as soon as one of them lags two
    positions."""
    monkeypatch.setattr(draft_lag, "MAX_LAG", 5)
    seen: dict = {"forwards": 0, "plain": [], "reqs": {}, "retracted": []}
    forward, decode_plain, step = DraftRunner.forward, EagleWorker.decode_plain, Scheduler.step

    def count(self, *args, **kwargs):
        seen["forwards"] += 1
        return forward(self, *args, **kwargs)

    def plain(self, reqs):
        full = any(r.draft_lag and len(r.draft_lag.tokens) == draft_lag.MAX_LAG - 1 for r in reqs)
        before = seen["forwards"]
        result = decode_plain(self, reqs)
        seen["plain"].append((full, seen["forwards"] - before))
        seen["reqs"].update((id(r), r) for r in reqs)
        return result

    def retract_once(self):
        step(self)
        lagging = [r for r in self.running if r.draft_lag and len(r.draft_lag.tokens) >= 2]
        if lagging and not seen["retracted"]:
            seen["retracted"] = list(self.running)
            self.retract_all()

    monkeypatch.setattr(DraftRunner, "forward", count)
    monkeypatch.setattr(EagleWorker, "decode_plain", plain)
    monkeypatch.setattr(Scheduler, "step", retract_once)
    return seen


@pytest.mark.parametrize("name", list(CONFIGS))
def test_switching_every_few_steps_is_lossless_and_keeps_the_draft_in_step(
    models, name, alternating, spied
):
    """Requests of different prompt lengths, the later ones joining mid-run, under PATTERN,
    the first ones retracted once while their draft lags: greedy outputs equal the target
    alone's, and so does a continuation served from the prefix cache the run filled. A plain
    step runs the draft only when a request's lag reaches MAX_LAG; no request keeps a record
    after its release. Afterwards the draft KV the run left for a finished request (positions
    decoded plainly included; those its draft still lagged at when it finished stay out of the
    prefix cache) equals what a prefill of its whole sequence computes: a speculative step that
    did not catch the draft up would have left those slots stale."""
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
    plain = spied["plain"]
    assert any(full for full, _ in plain) and any(not full for full, _ in plain)
    assert all((forwards > 0) == full for full, forwards in plain)


def test_a_draft_that_predicts_well_accepts_as_much_after_a_plain_stretch(models, alternating):
    """The target's copy as a STANDALONE draft (its own weights and KV, unlike a self-draft)
    predicts every greedy token: each verify round accepts all of its steps, plain stretches
    or not. A draft whose KV missed the plainly decoded tokens would mispredict after them."""
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
    assert report["speculative_steps"] > 0 and report["plain_steps"] > 0
    for out in outs:
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] > 0
        # Every verify accepts `steps` drafts and the bonus; a request's last may emit 1 of them
        # (max_new_tokens).
        assert meta["spec_accept_length"] >= steps + 1 - steps / meta["spec_verify_ct"] - 1e-9
