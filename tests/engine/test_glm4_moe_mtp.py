"""GLM-4.5's next-n (MTP) layer as a draft (models/glm4_moe_nextn.py), selected as SGLang does:
EAGLE or NEXTN with no draft path. Greedy speculation is lossless, sampling runs, every MTP
tensor has a slot and updates by name reach the draft, and the first draft level equals a
reference wired as SGLang's Glm4MoeModelNextN from transformers' GLM-4.5 decoder layer."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers.models.glm4_moe.modeling_glm4_moe import (
    Glm4MoeConfig,
    Glm4MoeDecoderLayer,
    Glm4MoeRotaryEmbedding,
)

from spec_engine import Engine
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.registry import model_class, mtp_class
from spec_engine.weights.loader import tensor_checksum, weight_spec
from tests.conftest import FAMILIES, random_prompts
from tests.engine.test_draft_models import (
    PROMPT,
    assert_first_level,
    engine_first_level,
    load_layer,
    target_states,
)

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
GRAPHS = dict(cuda_graph_bs=[1, 2, 4], cuda_graph_self_check=True, max_running_requests=4)
SPEC = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4)
N = 3  # the tiny GLM's trunk layers: its MTP layer is model.layers.3.*
# The checkpoint's copies of the target's embedding and head: SGLang's NextN loader skips them
# and its EAGLE worker hands the draft the target's own (set_embed_and_head).
SHARED = ("model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight")


@pytest.fixture(scope="module")
def glm(make_model) -> str:
    return make_model(**FAMILIES["glm4_moe"])


def _ids(engine: Engine, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


def test_every_mtp_tensor_has_a_draft_slot(glm):
    config = ModelConfig.from_pretrained(glm)
    assert mtp_class(config).__name__ == "Glm4MoeNextN"
    mtp = {
        n
        for n in load_file(os.path.join(glm, "model.safetensors"))
        if n.startswith("model.layers.3.")
    }
    draft = weight_spec(mtp_class(config)(config))
    assert set(draft) == mtp - set(SHARED)
    assert all(slot.param is not None for slot in draft.values())
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in draft  # always the MoE, as SGLang
    target = weight_spec(model_class(config)(config))
    assert all(target[n].param is None and target[n].optional for n in SHARED)


@pytest.mark.parametrize("algorithm", ["EAGLE", "NEXTN"])
def test_greedy_is_lossless_and_sampling_runs(glm, algorithm):
    prompts = random_prompts(4, 3, 25, seed=31)
    with Engine(model_path=glm, random_seed=0, **GRAPHS) as engine:
        plain = _ids(engine, prompts)
    with Engine(
        model_path=glm, random_seed=0, speculative_algorithm=algorithm, **SPEC, **GRAPHS
    ) as engine:
        assert engine.scheduler.worker.draft.kind.name == "MTP"
        assert _ids(engine, prompts) == plain
        sampled = _ids(engine, prompts, {"temperature": 1.0, "max_new_tokens": 8})
    assert [len(s) for s in sampled] == [8] * len(prompts)


def test_draft_weights_come_from_the_checkpoint_and_updates_by_name(glm):
    tensors = load_file(os.path.join(glm, "model.safetensors"))
    names = sorted(n for n in tensors if n.startswith("model.layers.3.") and n not in SHARED)
    prompts = random_prompts(3, 3, 20, seed=32)
    with Engine(model_path=glm, random_seed=0, speculative_algorithm="EAGLE", **SPEC) as engine:
        sums = engine.get_weights_checksum()
        assert {n: sums[n] for n in names} == {n: tensor_checksum(tensors[n]) for n in names}
        before = _ids(engine, prompts)
        draft = engine.scheduler.worker.draft.model
        old = draft.eh_proj.weight.detach().clone()
        new = {n: torch.randn_like(tensors[n]) * 0.1 for n in ("model.layers.3.eh_proj.weight",)}
        new["model.layers.3.mlp.experts.2.up_proj.weight"] = torch.randn_like(
            tensors["model.layers.3.mlp.experts.2.up_proj.weight"]
        )
        assert engine.update_weights_from_tensor(list(new.items()))["success"]
        assert not draft.eh_proj.weight.equal(old)
        after = engine.get_weights_checksum(list(new))
        assert after == {n: tensor_checksum(t) for n, t in new.items()}
        assert _ids(engine, prompts) == before  # still lossless: the trunk did not change


def test_first_draft_level_equals_sglang_nextn_reference(glm, hf):
    probs, ids, out, _ = engine_first_level(glm, speculative_algorithm="EAGLE")
    hidden, nxt = target_states(hf, glm)
    assert out == [nxt]
    w = load_file(os.path.join(glm, "model.safetensors"))
    config = Glm4MoeConfig.from_pretrained(glm)
    config._attn_implementation = "sdpa"
    p = f"model.layers.{N}."

    def rms(name, x):
        eps = config.rms_norm_eps
        return w[p + name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    n = len(PROMPT)
    with torch.no_grad():
        # No masking at position 0 (SGLang's GLM NextN, unlike MiMo); the embedding comes first.
        embeds = w["model.embed_tokens.weight"][PROMPT[1:] + [nxt]]
        x = F.linear(
            torch.cat((rms("enorm.weight", embeds), rms("hnorm.weight", hidden[-1][0])), -1),
            w[p + "eh_proj.weight"],
        )
        layer = Glm4MoeDecoderLayer(config, N).eval()  # layer N >= first_k_dense_replace: MoE
        experts = range(config.n_routed_experts)
        e = p + "mlp.experts."
        fused = {  # transformers keeps the experts as [E, ...] tensors
            e + "gate_up_proj": torch.stack(
                [
                    torch.cat((w[f"{e}{i}.gate_proj.weight"], w[f"{e}{i}.up_proj.weight"]))
                    for i in experts
                ]
            ),
            e + "down_proj": torch.stack([w[f"{e}{i}.down_proj.weight"] for i in experts]),
        }
        load_layer(layer, {**w, **fused}, p)
        rope = Glm4MoeRotaryEmbedding(config)(torch.zeros(1, n, 1), torch.arange(n)[None])
        x = layer(x[None], position_embeddings=rope)[0]
        logits = F.linear(rms("shared_head.norm.weight", x[-1]), w["lm_head.weight"])
    assert_first_level(logits, probs, ids)
