"""The engine on checkpoints laid out as the releases are published (tiny/releases.py): GLM-4.5
and GLM-4.5-Air (a next-n layer carrying `embed_tokens` and `shared_head.head` copies) and Qwen3,
split over shards with an index, give transformers' greedy tokens and log-probs; MiMo's release
layout drafts losslessly with its MTP layer; an EAGLE-3 draft as published (`d2t`/`t2d` draft
vocabulary, `pytorch_model.bin`, a `max_position_embeddings` shorter than the target's) drafts
losslessly past its own length. The FP8 DeepSeek-V3 release:
tests/engine/test_fp8_checkpoints.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import FAMILIES, GLM45_AIR
from safetensors.torch import load_file

from spec_engine import Engine
from tests.conftest import random_prompts
from tests.engine.test_engine_greedy import assert_matches_hf
from tiny.checkpoints import add_mimo_mtp, build_eagle_draft
from tiny.releases import to_sharded_release

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
RELEASES = {"glm4_5": FAMILIES["glm4_moe"], "glm4_5_air": GLM45_AIR, "qwen3": FAMILIES["qwen3"]}
SPEC = dict(speculative_num_steps=2, speculative_eagle_topk=1, speculative_num_draft_tokens=3)


def _generate(path: str, prompts: list[list[int]], params=GREEDY, **kw) -> list[dict]:
    with Engine(model_path=path, random_seed=0, **kw) as engine:
        return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_sharded_release_matches_transformers(make_model, hf, tmp_path, name):
    path = to_sharded_release(make_model(**RELEASES[name]), str(tmp_path / name))
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) == 3
    prompts = random_prompts(2, 3, 20, seed=61)
    outs = _generate(path, prompts)
    assert_matches_hf(hf, path, prompts, outs, GREEDY["max_new_tokens"])
    if name.startswith("glm"):  # the next-n layer with its copies drafts losslessly
        spec = _generate(path, prompts, speculative_algorithm="NEXTN", **SPEC)
        assert _ids(spec) == _ids(outs)
        assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in spec)


def test_mimo_release_drafts_losslessly(make_model, tmp_path):
    src = str(tmp_path / "mimo-src")
    shutil.copytree(make_model(arch="qwen2", num_layers=2, seed=11), src)
    path = to_sharded_release(add_mimo_mtp(src), str(tmp_path / "mimo"))
    prompts = random_prompts(2, 3, 20, seed=62)
    plain = _generate(path, prompts)
    assert _ids(_generate(path, prompts, speculative_algorithm="EAGLE", **SPEC)) == _ids(plain)


def test_published_eagle3_draft_loads_and_drafts_past_its_max_positions(make_model, tmp_path):
    """As published (e.g. EAGLE3-LLaMA3.1-Instruct-8B: pytorch_model.bin, 2048 positions for a
    131072-position target): the draft's shorter max_position_embeddings does not bound the
    target's context."""
    target = make_model("llama", num_layers=4)
    draft = build_eagle_draft(str(tmp_path / "eagle3"), target, version=3, draft_vocab_size=96)
    tensors = load_file(os.path.join(draft, "model.safetensors"))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    os.remove(os.path.join(draft, "model.safetensors"))
    torch.save(tensors, os.path.join(draft, "pytorch_model.bin"))
    with open(os.path.join(draft, "config.json")) as f:
        config = json.load(f)
    config["max_position_embeddings"] = 32
    with open(os.path.join(draft, "config.json"), "w") as f:
        json.dump(config, f)
    prompts = random_prompts(2, 30, 31, seed=63)
    params = {**GREEDY, "max_new_tokens": 12}
    plain = _generate(target, prompts, params)
    spec = _generate(
        target,
        prompts,
        params,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft,
        **SPEC,
    )
    assert _ids(spec) == _ids(plain)
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in spec)
    assert all(len(o["output_ids"]) + 30 > 32 for o in spec)
