"""Sampled tree verification walks every request of a step together (one host copy of the
children's probabilities, one batched residual draw): each request's walk must not depend on
which others share its step, and the rounding corner of the walk must still hold."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from spec_engine.core.readback import read_back
from spec_engine.speculative import verify
from spec_engine.speculative.tree import DraftTree


def _tree(rng: random.Random, vocab: int, size: int) -> DraftTree:
    tokens, parents, depths = [rng.randrange(vocab)], [-1], [0]
    for node in range(1, size):
        parent = rng.randrange(node)
        siblings = {tokens[k] for k in range(node) if parents[k] == parent}
        token = rng.choice([t for t in range(vocab) if t not in siblings])
        tokens.append(token)
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return DraftTree(tokens, parents, depths)


def _req(rng: random.Random, greedy: bool, outputs: int = 0) -> SimpleNamespace:
    params = SimpleNamespace(
        is_greedy=greedy,
        logit_scale=1.0 if greedy else rng.choice([0.7, 1.0, 1.3]),
        top_k=rng.choice([-1, 4]),
        top_p=rng.choice([1.0, 0.9]),
        min_p=0.0,
    )
    return SimpleNamespace(
        input=SimpleNamespace(sampling_params=params, seed=rng.randrange(1 << 40)),
        output_ids=[0] * (outputs or rng.randrange(30)),
    )


def test_each_sampled_walk_is_the_same_alone_as_in_its_batch():
    """60 random batches of trees (greedy and sampled requests, filters, lossy thresholds):
    every request's accepted path, emitted tokens and rows equal those of verifying it alone."""
    rng = random.Random(7)
    walks = accepted = 0
    for _ in range(60):
        vocab, batch = rng.choice([6, 40]), rng.randrange(2, 9)
        trees = [_tree(rng, vocab, rng.randrange(1, 7)) for _ in range(batch)]
        reqs = [_req(rng, rng.random() < 0.25) for _ in range(batch)]
        sizes = [t.size for t in trees]
        g = torch.Generator(device="cpu").manual_seed(len(sizes))
        logits = torch.randn(sum(sizes), vocab, generator=g, device="cpu")
        offset = 0
        for tree in trees:  # make drafts likely so that walks go deep
            for node in range(1, tree.size):
                logits[offset + tree.parents[node], tree.tokens[node]] += 3.0
            offset += tree.size
        thresholds = rng.choice([(1.0, 1.0), (0.3, 1.0), (1.0, 0.6)])
        together = verify.verify_trees(logits, trees, reqs, [[]] * batch, *thresholds)[0]
        # The engine's walk reads the step's NaN flags in the argmax's copy: same walks.
        flags = torch.rand(sum(sizes), generator=g, device="cpu") < 0.2
        # The engine's walk reads the step's NaN flags and the emitted tokens' log-probs in the
        # argmax's copy: the same walks, and log-probs as log_softmax of the emitted rows.
        flags = torch.arange(sum(sizes), device="cpu") % 3 == 1
        asked = verify.LogprobAsk([True] * batch, [2 * (i % 2) for i in range(batch)])
        walked, read, logprobs, top, _ = verify.verify_trees(
            logits, trees, reqs, [[]] * batch, *thresholds, flags=flags, asked=asked
        )
        assert read == [int(f) for f in flags.tolist()]
        assert [(w.path, w.tokens, w.rows) for w in walked] == [
            (t.path, t.tokens, t.rows) for t in together
        ]
        for acc, req, lps, tops, n in zip(
            walked, reqs, logprobs, top or [[]] * batch, asked.top_nums
        ):
            temp = torch.tensor(req.input.sampling_params.logit_scale, device="cpu")
            logp = torch.log_softmax(logits[acc.rows] / temp, -1)
            assert lps == logp[range(len(acc.rows)), acc.tokens].tolist()
            vals, ids = logp.topk(2, dim=-1)
            assert tops == (
                [list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist())] if n else []
            )
        offset = 0
        for tree, req, got in zip(trees, reqs, together):
            alone = verify.verify_trees(
                logits[offset : offset + tree.size], [tree], [req], [[]], *thresholds
            )[0][0]
            assert (got.path, got.tokens) == (alone.path, alone.tokens)
            assert got.rows == [offset + row for row in alone.rows]
            offset += tree.size
            walks += 1
            accepted += len(got.path) - 1
    assert walks > 200 and accepted > walks  # deep walks, not only rejections at the root


def test_children_holding_all_the_mass_accept_the_last_child_and_the_walk_goes_on(monkeypatch):
    """u above the children's float sum while they hold every bit of the target's mass: the
    residual is empty, so the last child is accepted and the walk continues below it (here to a
    leaf, whose own distribution draws the bonus token); another request in the same step is
    drawn from its residual as usual."""
    monkeypatch.setattr(verify, "request_uniform", lambda seed, index, stream=0: 1 - 2**-20)
    tree = DraftTree([0, 1, 2], [-1, 0, 0], [0, 1, 1])  # a root with two children
    probs = torch.zeros(6, 5, device="cpu")
    probs[0, 1], probs[0, 2] = 0.5, 0.4999  # request 0: the children hold all the mass
    probs[2, 3] = 1.0  # request 0, below child 2: token 3 is all there is
    probs[3] = torch.tensor([0.1, 0.1, 0.1, 0.2, 0.5], device="cpu")  # request 1's root
    walks = [
        verify._SampledWalk(tree, 0, _req(random.Random(0), False, outputs=4)),
        verify._SampledWalk(tree, 3, _req(random.Random(1), False, outputs=9)),
    ]
    values = read_back(*verify._walk_inputs(walks, probs))
    verify._walk_host(walks, *values, threshold_single=1.0, threshold_acc=1.0)
    assert (walks[0].path, walks[0].tokens, walks[0].rows) == ([0, 2], [2, 3], [0, 2])
    assert walks[0].level == 5
    # Request 1: u = 1 - 2^-20 passes 0.1 + 0.1; the residual without tokens 1, 2 draws token 4.
    assert (walks[1].path, walks[1].tokens, walks[1].rows) == ([0], [4], [3])
