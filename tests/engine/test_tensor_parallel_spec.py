"""Speculative decoding at --tp-size 2 on the CPU (two gloo ranks, rank 1 forked), drafts at the
target's TP as SGLang runs them: for each algorithm the draft trees, greedy tokens, accept
lengths, a seeded sampled request and (EAGLE-3, updated from tensors) the draft's checksums
equal the same speculation at tp 1, and the greedy tokens equal plain decoding (log-probs within
1e-4 in float32), with the emulated graphs (padding, and the self-check with EAGLE) running the
collectives inside; --speculative-adaptive runs the depths rank 0 chose; what tp > 1 does not
run is refused."""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file

from spec_engine import Engine
from spec_engine.speculative.base import SpecWorker
from spec_engine.speculative.tree import host_trees
from tiny.checkpoints import add_mimo_mtp, build_eagle_draft


@pytest.fixture(scope="module", autouse=True)
def forked_ranks() -> Iterator[None]:
    """Rank 1 forked from tests/support/forkserver.py's server (see test_tensor_parallel.py)."""
    from spec_engine.distributed import launch
    from tests.support.forkserver import instead_of_spawn

    with instead_of_spawn(launch):
        yield


@pytest.fixture(scope="module")
def models(make_model, tmp_path_factory) -> dict[str, str]:
    """A Llama target with one KV head (replicated at tp 2); its EAGLE-2 draft, its EAGLE-3
    draft over a draft vocabulary of 127 (a vocabulary-parallel head with a padded last block,
    and d2t) and another one to update it to, a copy of it as a STANDALONE draft (a model of
    its own that accepts every token); a MiMo target with its MTP layer; a GLM-4.5 target (MoE
    experts split by TP) and a DeepSeek-V3 target (MLA by heads), each with its next-n layer."""
    from tests.conftest import FAMILIES

    target = make_model("llama", num_layers=4, num_kv_heads=1)
    root = tmp_path_factory.mktemp("tp_drafts")
    return {
        "target": target,
        "eagle": build_eagle_draft(str(root / "eagle"), target, version=2),
        "eagle3": build_eagle_draft(str(root / "eagle3"), target, version=3, draft_vocab_size=127),
        "eagle3_b": build_eagle_draft(
            str(root / "eagle3_b"), target, version=3, draft_vocab_size=127, seed=9
        ),
        "copy": shutil.copytree(target, str(root / "copy")),
        "mimo": add_mimo_mtp(make_model("qwen2", num_layers=2, seed=7)),
        "glm4_moe": make_model(**FAMILIES["glm4_moe"]),
        "deepseek_v3": make_model(
            "deepseek_v3", num_layers=3, extra_config={"num_nextn_predict_layers": 1}
        ),
    }


ENGINE = dict(
    skip_tokenizer_init=True, max_total_tokens=512, device="cpu", log_level="warning", random_seed=0
)
# At tp 2 every step's tokens are compared between the ranks, and the steps run the emulated
# graphs (batches padded to 1, 2 or 4 rows), the target's verify and the draft's steps and extend;
# with EAGLE they are checked against the eager forwards at startup (the self-check: seconds).
CHECKS = dict(debug_tp_check_tokens=True, cuda_graph_max_bs=4)
SELF_CHECK = {"eagle": dict(cuda_graph_self_check=True)}
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
CONFIGS = {
    "ngram": ("target", dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)),
    "ngram-glm4_moe": (
        "glm4_moe",
        dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6),
    ),
    "eagle": ("target", dict(speculative_algorithm="EAGLE", draft="eagle", **TREE)),
    "eagle3": (
        "target",
        dict(speculative_algorithm="EAGLE3", draft="eagle3", update="eagle3_b", **TREE),
    ),
    "standalone": ("target", dict(speculative_algorithm="STANDALONE", draft="copy", **TREE)),
    "mtp": (
        "mimo",
        dict(speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1),
    ),
    # The next-n layers of the MoE families: their MoE split as the target's, MLA by heads.
    "mtp-glm4_moe": (
        "glm4_moe",
        dict(speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1),
    ),
    "mtp-deepseek_v3": (
        "deepseek_v3",
        dict(speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1),
    ),
}
# Repetitive prompts (the n-gram cache drafts from them); the third request samples, seeded.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13, 11, 12, 13, 11], [5, 6, 7, 8]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 3}
_PLAIN: dict[str, list[dict]] = {}
_CHECKSUMS: dict[str, dict[str, str]] = {}


@pytest.fixture
def trees(monkeypatch) -> list:
    """Every draft tree verified in this process (rank 0's), as (tokens, parents)."""
    seen: list = []
    verify = SpecWorker.verify

    def recording(self, reqs, trees, on_host=None):
        # The trees live on the device: read here, for the record.
        seen.append([(t.tokens, t.parents) for t in host_trees(trees)])
        return verify(self, reqs, trees, on_host)

    monkeypatch.setattr(SpecWorker, "verify", recording)
    return seen


def _generate(engine: Engine) -> list[dict]:
    return engine.generate(
        input_ids=PROMPTS, sampling_params=[GREEDY, GREEDY, SAMPLED], return_logprob=True
    )


def _run(path: str, tp_size: int, update: Optional[str] = None, **kwargs) -> tuple[list[dict], int]:
    """The outputs, and how many weights this rank's draft model holds (0: none). `update`: a
    draft checkpoint whose tensors replace the draft's first (update_weights_from_tensor, whole
    tensors: each rank takes its blocks); the draft's checksums are checked against tp 1's."""
    with Engine(model_path=path, tp_size=tp_size, **ENGINE, **kwargs) as engine:
        draft = engine.updater.draft
        weights = sum(p.numel() for p in draft.model.parameters()) if draft is not None else 0
        if update is not None:
            tensors = load_file(os.path.join(update, "model.safetensors"))
            engine.update_weights_from_tensor([("draft." + n, t) for n, t in tensors.items()])
            sums = {n: v for n, v in engine.get_weights_checksum().items() if n[:6] == "draft."}
            assert _CHECKSUMS.setdefault(update, sums) == sums
        return _generate(engine), weights


def _plain(path: str) -> list[dict]:
    if path not in _PLAIN:
        _PLAIN[path] = _run(path, 1)[0]
    return _PLAIN[path]


def _assert_close(outs: list[dict], refs: list[dict]) -> None:
    for out, ref in zip(outs, refs):
        assert out["output_ids"] == ref["output_ids"]
        lp = [[x for x, _, _ in o["meta_info"]["output_token_logprobs"]] for o in (out, ref)]
        assert max(abs(a - b) for a, b in zip(*lp)) < 1e-4


def _accepts(outs: list[dict]) -> list[tuple[int, float]]:
    return [(o["meta_info"]["spec_verify_ct"], o["meta_info"]["spec_accept_length"]) for o in outs]


def _spec(name: str, models: dict[str, str]) -> tuple[str, dict]:
    key, spec = CONFIGS[name]
    spec = dict(spec)
    if "draft" in spec:
        spec["speculative_draft_model_path"] = models[spec.pop("draft")]
    if "update" in spec:
        spec["update"] = models[spec["update"]]
    return models[key], spec


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp2_speculation_equals_tp1(name, models, trees):
    path, spec = _spec(name, models)
    one, draft_one = _run(path, 1, **spec)
    trees_one = list(trees)
    trees.clear()
    two, draft_two = _run(path, 2, **CHECKS, **SELF_CHECK.get(name, {}), **spec)
    assert trees == trees_one
    if not name.startswith(
        "ngram"
    ):  # the draft's layers are split over the ranks (its fc is replicated)
        assert 0 < draft_two < draft_one
    _assert_close(two, one)
    _assert_close(two[:2], _plain(path)[:2])
    assert _accepts(two) == _accepts(one)
    if name in ("ngram", "ngram-glm4_moe", "standalone"):  # drafts the target accepts
        assert max(length for _, length in _accepts(two)[:2]) > 1.1


def test_tp2_adaptive_depths_are_rank_0s(models):
    """--speculative-adaptive measures step times per process; rank 1 runs the depths rank 0
    chose (here forced through every plain and speculative depth in turn, which rank 1's own
    cost model would not choose), and stays lossless."""
    path, spec = _spec("eagle", models)
    chosen: list[int] = []
    with Engine(
        model_path=path,
        tp_size=2,
        speculative_adaptive=True,
        dist_timeout=60,
        **ENGINE,
        **CHECKS,
        **spec,
    ) as engine:
        depths = [0, *sorted(engine.scheduler.worker.shapes)]
        forced = itertools.cycle(depths)
        engine.scheduler.policy.adaptive.choose = lambda *_: (
            chosen.append(next(forced)) or chosen[-1]
        )
        outs = _generate(engine)
    assert set(chosen) == set(depths)
    _assert_close(outs[:2], _plain(path)[:2])


@pytest.mark.parametrize(
    "draft, kwargs, match",
    [
        (
            "eagle",
            dict(speculative_algorithm="EAGLE", speculative_token_map="hot.pt"),
            r"--tp-size 2: --speculative-token-map \(FR-Spec\) .* drop it at --tp-size > 1",
        ),
    ],
)
def test_what_tp2_speculation_does_not_run_is_refused(draft, kwargs, match, models, tmp_path):
    path = models["target"]
    kwargs = dict(kwargs, speculative_draft_model_path=models[draft])
    torch.save(torch.arange(5, 300), str(tmp_path / "hot.pt"))
    kwargs["speculative_token_map"] = str(tmp_path / "hot.pt")
    with pytest.raises(ValueError, match=match):
        Engine(model_path=path, tp_size=2, **ENGINE, **kwargs)
