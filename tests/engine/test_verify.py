"""Draft trees and their verification on the device (speculative/tree.py's `select_trees` and
`tree_masks`, speculative/verify.py's `walk_trees`): every request's tree and walk at once, bit
for bit what the engine built and walked on the host before (tests/support/host_walk.py, today's
code kept as the oracle), node for node and token for token; and a request's walk does not
depend on which others share its step."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from spec_engine.speculative import verify
from spec_engine.speculative.tree import (
    DraftTree,
    host_trees,
    select_trees,
    tree_masks,
    tree_tensors,
)
from tests.support import host_walk

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    """Tensors of a few dozen values: a thread pool only adds wake-ups (on a busy machine,
    milliseconds per op)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tree(rng: random.Random, vocab: int, size: int, topk: int = 0, depth: int = 0) -> DraftTree:
    """A random tree of at most `size` nodes, parents before children; with `topk`, at most topk
    children a node and at most `depth` levels, sibling tokens may repeat (EAGLE's trees may
    hold a token twice under one parent)."""
    tokens, parents, depths = [rng.randrange(vocab)], [-1], [0]
    kids = [0]
    for _ in range(1, size):
        open_ = [
            k for k in range(len(tokens)) if not topk or (kids[k] < topk and depths[k] < depth)
        ]
        if not open_:
            break
        parent = rng.choice(open_)
        siblings = {tokens[k] for k in range(len(tokens)) if parents[k] == parent}
        fresh = [t for t in range(vocab) if t not in siblings]
        token = rng.choice(sorted(siblings)) if topk and siblings and rng.random() < 0.3 else None
        tokens.append(rng.choice(fresh) if token is None else token)
        parents.append(parent)
        depths.append(depths[parent] + 1)
        kids[parent] += 1
        kids.append(0)
    return DraftTree(tokens, parents, depths)


def _req(rng: random.Random, greedy: bool, outputs: int = 0) -> SimpleNamespace:
    params = SimpleNamespace(
        is_greedy=greedy,
        logit_scale=1.0 if greedy else rng.choice([0.7, 1.0, 1.3]),
        top_k=rng.choice([-1, 4, 2, 1]),
        top_p=rng.choice([1.0, 0.9]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
    )
    return SimpleNamespace(
        input=SimpleNamespace(sampling_params=params, seed=rng.randrange(1 << 40)),
        output_ids=[0] * (outputs or rng.randrange(30)),
    )


def _logits(trees: list[DraftTree], vocab: int, g: torch.Generator) -> torch.Tensor:
    """Random target logits, the drafts made likely so that walks go deep; some rows hold all
    their mass on their children's tokens (empty residuals)."""
    logits = torch.randn(sum(t.size for t in trees), vocab, generator=g, device=CPU)
    offset = 0
    for tree in trees:
        for node in range(1, tree.size):
            logits[offset + tree.parents[node], tree.tokens[node]] += 3.0
        for node, kids in enumerate(tree.children()):
            if kids and torch.rand(1, generator=g, device=CPU).item() < 0.7:
                keep = logits[offset + node, [tree.tokens[k] for k in kids]].clone()
                logits[offset + node] = float("-inf")
                logits[offset + node, [tree.tokens[k] for k in kids]] = keep
        offset += tree.size
    return logits


def _walk(case: dict, device_walk: bool):
    if device_walk:
        trees = tree_tensors(case["trees"], CPU)
        return verify.verify_trees(case["logits"], trees, *case["args"], **case["kwargs"])[0]
    return host_walk.verify_trees(case["logits"], case["trees"], *case["args"], **case["kwargs"])


@pytest.mark.parametrize("seed", range(4))
def test_device_walks_equal_the_host_walk_node_for_node(seed, monkeypatch):
    """60 random batches per seed: trees of top-k 1..4 and depth 1..5 (repeated sibling tokens),
    greedy and sampled requests with top-k/top-p/min-p filters, temperatures, lossy thresholds,
    banned tokens per depth, uniforms near 1 (children holding all the mass: empty residuals):
    paths, emitted tokens, rows, flags and every asked log-prob equal the host walk's."""
    rng = random.Random(seed)
    near_one = {"on": False}
    real = verify.request_uniform

    def uniform(s, index, stream=0):
        return 1 - 2**-40 * (1 + index % 3) if near_one["on"] else real(s, index, stream)

    monkeypatch.setattr(verify, "request_uniform", uniform)
    monkeypatch.setattr(host_walk, "request_uniform", uniform)
    descents = []  # the host walk descends again after each empty-residual acceptance
    descend = host_walk._SampledWalk.descend
    monkeypatch.setattr(
        host_walk._SampledWalk, "descend", lambda w, *a: descents.append(id(w)) or descend(w, *a)
    )
    walks = accepted = dupes = fallbacks = 0
    for case_no in range(60):
        near_one["on"] = case_no % 2 == 0
        vocab, batch = rng.choice([5, 8, 40]), rng.randrange(1, 7)
        topk, depth = rng.randrange(1, 5), rng.randrange(1, 6)
        trees = [_tree(rng, vocab, rng.randrange(1, 12), topk, depth) for _ in range(batch)]
        reqs = [_req(rng, rng.random() < 0.3) for _ in range(batch)]
        if near_one["on"]:  # unfiltered: several children share an empty row's mass
            for r in reqs:
                r.input.sampling_params.top_k, r.input.sampling_params.top_p = -1, 1.0
        g = torch.Generator(device=CPU).manual_seed(case_no + 1000 * seed)
        logits = _logits(trees, vocab, g)
        sizes = [t.size for t in trees]
        banned = [
            [
                rng.sample(range(vocab), rng.randrange(3)) if rng.random() < 0.2 else []
                for _ in range(6)
            ]
            for _ in trees
        ]
        asked = verify.LogprobAsk(
            [rng.random() < 0.7 for _ in trees],
            [rng.choice([0, 1, 3]) for _ in trees],
            [tuple(rng.sample(range(vocab), rng.randrange(3))) for _ in trees],
        )
        thresholds = rng.choice([(1.0, 1.0), (0.3, 1.0), (1.0, 0.6), (0.5, 0.5)])
        if near_one["on"]:  # lossless: u near 1 then passes only a float sum of all the mass
            thresholds = (1.0, 1.0)
        flags = torch.rand(sum(sizes), generator=g, device=CPU) < 0.2
        case = dict(
            trees=trees,
            logits=logits,
            args=(reqs, banned, *thresholds),
            kwargs=dict(flags=flags, asked=asked),
        )
        descents.clear()
        got, want = _walk(case, True), _walk(case, False)
        fallbacks += len(descents) - len(set(descents))
        assert [(a.path, a.tokens, a.rows) for a in got.accepts] == [
            (a.path, a.tokens, a.rows) for a in want.accepts
        ]
        assert got[1:] == want[1:]  # flags, log-probs, top log-probs, token_ids log-probs
        for tree, acc in zip(trees, want.accepts):
            walks += 1
            accepted += len(acc.path) - 1
            kids = tree.children()
            dupes += any(len({tree.tokens[k] for k in ks}) < len(ks) for ks in kids)
    assert walks > 150 and accepted > walks and dupes > 40 and fallbacks >= 3


def test_each_walk_is_the_same_alone_as_in_its_batch():
    """Every request's accepted path, emitted tokens and rows in a batch of random trees equal
    those of verifying it alone (its rows shifted by its offset)."""
    rng = random.Random(7)
    walks = 0
    for _ in range(30):
        vocab, batch = rng.choice([6, 40]), rng.randrange(2, 9)
        trees = [_tree(rng, vocab, rng.randrange(1, 7)) for _ in range(batch)]
        reqs = [_req(rng, rng.random() < 0.25) for _ in range(batch)]
        g = torch.Generator(device=CPU).manual_seed(batch)
        logits = _logits(trees, vocab, g)
        thresholds = rng.choice([(1.0, 1.0), (0.3, 1.0), (1.0, 0.6)])
        together = verify.verify_trees(
            logits, tree_tensors(trees, CPU), reqs, [[]] * batch, *thresholds
        )[0].accepts
        offset = 0
        for tree, req, got in zip(trees, reqs, together):
            alone = verify.verify_trees(
                logits[offset : offset + tree.size],
                tree_tensors([tree], CPU),
                [req],
                [[]],
                *thresholds,
            )[0].accepts[0]
            assert (got.path, got.tokens) == (alone.path, alone.tokens)
            assert got.rows == [offset + row for row in alone.rows]
            offset += tree.size
            walks += 1
    assert walks > 100


def test_children_holding_all_the_mass_accept_the_last_child_and_the_walk_goes_on(monkeypatch):
    """u above the children's float sum while they hold every bit of the target's mass: the
    residual is empty, so the last child is accepted and the walk continues below it (here to a
    leaf, whose own distribution draws the bonus token); another request in the same step is
    drawn from its residual as usual."""
    monkeypatch.setattr(verify, "request_uniform", lambda seed, index, stream=0: 1 - 2**-20)
    tree = DraftTree([0, 1, 2], [-1, 0, 0], [0, 1, 1])  # a root with two children
    probs = torch.zeros(6, 5, device=CPU)
    probs[0, 1], probs[0, 2] = 0.5, 0.4999  # request 0: the children hold all the mass
    probs[2, 3] = 1.0  # request 0, below child 2: token 3 is all there is
    probs[3] = torch.tensor([0.1, 0.1, 0.1, 0.2, 0.5], device=CPU)  # request 1's root
    reqs = [_req(random.Random(0), False, outputs=4), _req(random.Random(1), False, outputs=9)]
    walk = verify.walk_trees(tree_tensors([tree, tree], CPU), probs.argmax(-1), probs, reqs, [0, 1])
    assert walk.accepted.tolist() == [1, 0]
    assert walk.path.tolist() == [[0, 2], [0, 0]]
    # Request 1: u = 1 - 2^-20 passes 0.1 + 0.1; the residual without tokens 1, 2 draws token 4.
    assert walk.tokens.tolist() == [[2, 3], [4, 4]]
    assert walk.rows.tolist()[0] == [0, 2] and walk.rows.tolist()[1][0] == 3


def _candidates(g: torch.Generator, b: int, k: int, steps: int) -> tuple[torch.Tensor, ...]:
    """EAGLE's draft candidates (eagle_worker._draft_trees' expansion with random draft
    probabilities drawn from a few values, so that scores tie): tokens, scores, parents [B, C],
    depths [C]."""
    values = torch.tensor([0.5, 0.25, 0.125, 0.6], device=CPU)

    def probs(rows: int) -> torch.Tensor:
        return values[torch.randint(0, 4, (rows, k), generator=g, device=CPU)]

    scores, tokens = [probs(b)], [torch.randint(0, 9, (b, k), generator=g, device=CPU)]
    parents = [torch.full((b, k), -1, dtype=torch.int64, device=CPU)]
    depths = [torch.ones(k, dtype=torch.int64, device=CPU)]
    frontier, f_scores, offset = torch.arange(k, device=CPU).expand(b, k), scores[0], k
    for step in range(1, steps):
        child = (f_scores[:, :, None] * probs(b * k).view(b, k, k)).reshape(b, k * k)
        scores.append(child)
        tokens.append(torch.randint(0, 9, (b, k * k), generator=g, device=CPU))
        parents.append(frontier[:, :, None].expand(b, k, k).reshape(b, k * k))
        depths.append(torch.full((k * k,), step + 1, dtype=torch.int64, device=CPU))
        sel = child.topk(k, dim=-1).indices
        frontier, f_scores, offset = offset + sel, child.gather(1, sel), offset + k * k
    return torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1), torch.cat(depths)


def test_trees_and_masks_built_on_the_device_equal_the_host_built():
    """select_trees on the device (no read) keeps the candidates, parents and depths the host
    selection kept (ties to the shallower candidate), and each tree's attention mask (prefix,
    then its ancestors) is the host-built one, for top-k 1..4, depth 1..5, any tree size."""
    g = torch.Generator(device=CPU).manual_seed(3)
    rng = random.Random(3)
    for _ in range(40):
        b, k, steps = rng.randrange(1, 5), rng.randrange(1, 5), rng.randrange(1, 6)
        cands = _candidates(g, b, k, steps)
        nodes = rng.randrange(2, cands[0].shape[1] + 2)
        roots = [rng.randrange(9) for _ in range(b)]
        want = host_walk.select_trees(roots, *cands, nodes)
        trees = select_trees(torch.tensor(roots, device=CPU), *cands, nodes, depth=steps, fanout=k)
        got = host_trees(trees)
        assert [(t.tokens, t.parents, t.depths) for t in got] == [
            (t.tokens, t.parents, t.depths) for t in want
        ]
        kv_lens = [rng.randrange(4) for _ in range(b)]
        masks = tree_masks(trees, kv_lens, CPU)
        for mask, tree, kv in zip(masks, want, kv_lens):
            prefix = [[True] * kv + row for row in host_walk.tree_mask(tree)]
            assert mask.tolist() == prefix
