"""Host reads per decode step (issue #44): a plain step reads its results back once, and so
does a speculative one (its trees are built, verified and walked on the device; the verify's
walks, flags and log-probs come back in one copy), at batch 1, 32 and 128 alike; a tree step
whose requests walk their draft paths on the host (penalties) reads its trees too. On a GPU
every other read would stall the step on the device; the CPU runs the same step code, and
bench/host_reads.py counts the tensor-to-host calls it makes on the scheduler's thread."""

from __future__ import annotations

import math

import pytest
import torch

from bench.host_reads import HostCopies, HostReads, StepReads, worst
from spec_engine import Engine
from spec_engine.core.readback import read_back
from tests.conftest import random_prompts
from tiny.checkpoints import add_mimo_mtp, build_checkpoint, build_eagle_draft

BATCHES = (1, 32, 128)
# speculative_eagle_topk 2 draws a tree (several candidates per level) where the algorithm has one.
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
ALGORITHMS = {
    "plain": ("target", {}),
    "eagle2": ("target", dict(speculative_algorithm="EAGLE", draft="eagle", **TREE)),
    "eagle3": ("target", dict(speculative_algorithm="EAGLE3", draft="eagle3", **TREE)),
    "mtp": ("mimo", dict(speculative_algorithm="EAGLE", speculative_num_steps=2)),
    "standalone": ("target", dict(speculative_algorithm="STANDALONE", draft="small", **TREE)),
    "ngram": ("target", dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)),
}


@pytest.fixture(scope="module")
def models(make_model, tmp_path_factory):
    target = make_model("llama", num_layers=1)
    root = tmp_path_factory.mktemp("host-read-drafts")
    return {
        "target": target,
        "eagle": build_eagle_draft(str(root / "eagle"), target, version=2),
        "eagle3": build_eagle_draft(str(root / "eagle3"), target, version=3),
        "small": build_checkpoint(str(root / "small"), arch="llama", num_layers=1, seed=5),
        "mimo": add_mimo_mtp(make_model("qwen2", num_layers=1, seed=7)),
    }


GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
SAMPLED = {"temperature": 0.9, "top_k": 20, "max_new_tokens": 4, "ignore_eos": True}
ASKED = dict(return_logprob=True, top_logprobs_num=2, token_ids_logprob=[3, 7])


def open_engine(models: dict[str, str], name: str) -> Engine:
    """An engine of ALGORITHMS[name] over the module's tiny models, batch up to 128."""
    target, kwargs = ALGORITHMS[name]
    kwargs = dict(kwargs)
    if "draft" in kwargs:
        kwargs["speculative_draft_model_path"] = models[kwargs.pop("draft")]
    return Engine(
        model_path=models[target],
        random_seed=0,
        max_running_requests=max(BATCHES),
        context_length=128,
        **kwargs,
    )


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_decode_steps_read_the_host_once(models, name):
    """Every decode step at batch 1, 32 and 128 (requests finishing included), greedy, and
    sampled with top-k returning log-probs and top log-probs (sampled tree walks and log-probs
    are read in the verify's copy)."""
    kind = "plain" if name == "plain" else "spec"
    # A penalty walks each draft path on the host: the tree step reads its trees first.
    penalised = {"frequency_penalty": 0.5, "max_new_tokens": 4, "ignore_eos": True}
    with open_engine(models, name) as engine:
        for batch in BATCHES:
            prompts = random_prompts(batch, 3, 12, seed=batch)
            runs = [(dict(sampling_params=GREEDY), 1), (dict(sampling_params=SAMPLED, **ASKED), 1)]
            if name in ("eagle2", "standalone"):
                runs.append((dict(sampling_params=[penalised] + [GREEDY] * (batch - 1)), 2))
            for run, budget in runs:
                with StepReads(engine) as counted:
                    outs = engine.generate(input_ids=prompts, **run)
                assert all(len(o["output_ids"]) == 4 for o in outs)
                steps = counted.decode_steps()
                assert steps and {s.kind for s in steps} == {kind}
                assert max(s.batch for s in steps) == batch
                assert max(s.reads for s in steps) <= budget, (
                    f"{name} at batch {batch}: "
                    f"{[s.reads for s in steps]} reads per step:\n" + "\n".join(worst(steps))
                )


def test_read_back_gives_each_part_as_its_own_tolist_in_one_read():
    """Token ids up to 2**53, float32 log-probs (-inf and NaN among them), bools: the one copy
    through float64 is exact."""
    cpu = torch.device("cpu")
    ids = torch.tensor([[0, 7], [2**53 - 1, 151_935]], dtype=torch.int64, device=cpu)
    logp = torch.tensor([-0.1, float("-inf"), float("nan"), -1e-30], device=cpu)
    flags = torch.tensor([True, False, True], device=cpu)
    with HostReads() as reads:
        got_ids, none, got_logp, got_flags = read_back(ids, None, logp, flags)
    assert reads.count == 1
    assert got_ids == ids.reshape(-1).tolist() and all(type(v) is int for v in got_ids)
    assert none is None and got_flags == [1, 0, 1]
    want = logp.tolist()
    assert [math.isnan(v) for v in got_logp] == [math.isnan(v) for v in want]
    assert [v for v in got_logp if not math.isnan(v)] == [v for v in want if not math.isnan(v)]


@pytest.mark.parametrize("name", ["plain", "eagle3"])
def test_decode_steps_send_their_inputs_in_pinned_copies(models, name):
    """No tensor from host data but through mem/upload.py in a decode step (on a GPU,
    `torch.tensor(values, device=cuda)` is a pageable copy per array), at batch 1, 32 and 128,
    greedy and sampled with log-probs: a plain step makes four (the KV slots, their table
    cells, the forward's inputs, the sampling parameters); an EAGLE-3 tree step (its verify
    padded as a graph would be) makes more, each a pinned copy."""
    kind, most = ("plain", 4) if name == "plain" else ("spec", None)
    with open_engine(models, name) as engine:
        for batch in BATCHES:
            prompts = random_prompts(batch, 3, 12, seed=batch)
            for run in (dict(sampling_params=GREEDY), dict(sampling_params=SAMPLED, **ASKED)):
                with StepReads(engine, HostCopies) as counted:
                    engine.generate(input_ids=prompts, **run)
                steps = counted.decode_steps(kind)
                assert steps and max(s.batch for s in steps) == batch
                for s in steps:
                    kinds = {method for method, _ in s.sites}
                    assert kinds <= {"upload"}, "\n".join(worst([s]))
                    assert most is None or s.reads <= most, "\n".join(worst([s]))
