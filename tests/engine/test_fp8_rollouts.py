"""FP8 rollouts (--quantization fp8, weights/fp8.py): an engine quantizing a BF16 checkpoint at
load serves exactly what it serves from the FP8 release of the same weights (tiny/releases.py,
128 x 128 blocks), MTP layers included, for a MiMo (Qwen2 + MTP layer) and a DeepSeek-V3 (MLA,
routed and shared experts, next-n layer), and not what the unquantized engine serves; its weights
are DeepSeek's weight_quant then weight_dequant of the checkpoint's (tests/support/
fp8_reference.py); weight updates by every path (the trainer quantizing before it sends, or the
engine as the weights arrive) equal a fresh FP8 load of the new weights, checked by
--check-weight-update-equal; what cannot be served is refused with what to do instead."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spec_engine import Engine
from spec_engine.args.engine_args import EngineArgs
from spec_engine.weights.fp8 import DEFAULT_BLOCK, quantize, scale_name
from spec_engine.weights.loader import hf_tensor
from tests.conftest import random_prompts
from tests.support.fp8_reference import weight_dequant, weight_quant
from tiny.checkpoints import add_mimo_mtp
from tiny.releases import to_fp8_release
from trainer_bridge.weight_sync import WeightPusher, WeightSyncConfig, buckets

GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
PROMPTS = random_prompts(3, 4, 20, seed=61)
MTP_TREE = dict(speculative_num_steps=2, speculative_eagle_topk=1)
MTP = dict(speculative_algorithm="EAGLE", **MTP_TREE)
DOWN = "model.layers.1.mlp.down_proj.weight"  # 64 x 320: three blocks, the last cut short
MTP_UP = "model.mtp_layers.0.mlp.up_proj.weight"


def _bf16_exact(src: str, dst: str) -> str:
    """A float32 copy of `src` whose values BF16 holds exactly (an FP8 release keeps its
    embeddings, heads and norms in BF16: with these the two hold the same values)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = {n: t.to(torch.bfloat16).to(torch.float32) for n, t in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def _mimo(make_model, tmp_path_factory, seed: int) -> str:
    src = add_mimo_mtp(make_model("qwen2", intermediate_size=320, seed=seed), seed=seed + 1)
    return _bf16_exact(src, str(tmp_path_factory.mktemp(f"mimo-{seed}") / "ckpt"))


@pytest.fixture(scope="module")
def pair(make_model, tmp_path_factory) -> tuple[str, str]:
    """Two MiMo checkpoints (Qwen2 with an MTP layer) of different weights."""
    return _mimo(make_model, tmp_path_factory, 61), _mimo(make_model, tmp_path_factory, 63)


def _generate(engine: Engine) -> tuple[list[list[int]], list[float]]:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    logprobs = [lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
    return [o["output_ids"] for o in outs], logprobs


# Per family: tensors the release quantizes (of the target and of the MTP layer), and tensors it
# keeps (embeddings, heads, norms, routers, MiMo's input_proj, the next-n layer's eh_proj).
FAMILIES = {
    "mimo": (
        (DOWN, MTP_UP, "model.layers.0.self_attn.q_proj.weight"),
        ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")
        + ("model.mtp_layers.0.input_proj.weight",),
    ),
    "deepseek_v3": (
        ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight")
        + ("model.layers.1.mlp.shared_experts.up_proj.weight",)
        + ("model.layers.2.self_attn.kv_b_proj.weight", "model.layers.2.self_attn.q_a_proj.weight"),
        ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight")
        + ("model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.2.eh_proj.weight"),
    ),
}


@pytest.fixture(scope="module")
def deepseek_v3(make_model, tmp_path_factory) -> str:
    """A tiny DeepSeek-V3: MLA, a dense layer then MoE (routed and shared experts), a next-n
    layer."""
    src = make_model("deepseek_v3", num_layers=2, extra_config={"num_nextn_predict_layers": 1})
    return _bf16_exact(src, str(tmp_path_factory.mktemp("deepseek-v3") / "ckpt"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_quantized_at_load_serves_the_fp8_release(family, request, tmp_path):
    src = (
        request.getfixturevalue("pair")[0] if family == "mimo" else request.getfixturevalue(family)
    )
    quantized_names, kept = FAMILIES[family]
    release = to_fp8_release(src, str(tmp_path / "fp8"), DEFAULT_BLOCK)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    with Engine(model_path=src, random_seed=0, quantization="fp8", **MTP) as engine:
        info = engine.get_server_info()
        assert info["quantization"] == "fp8" and tuple(info["weight_block_size"]) == (128, 128)
        quantized = _generate(engine)
        assert engine.scheduler.worker.draft is not None  # the MTP layer drafts
        for name in quantized_names:
            reference = weight_dequant(*weight_quant(tensors[name], 128), 128)
            assert torch.equal(engine.updater.tensor(name), reference), name
            assert not torch.equal(reference, tensors[name])
        for name in kept:
            assert torch.equal(engine.updater.tensor(name), tensors[name]), name
    with Engine(model_path=release, random_seed=0, **MTP) as engine:
        assert engine.get_server_info()["quantization"] == "fp8"
        assert _generate(engine) == quantized
    with Engine(model_path=src, random_seed=0) as engine:
        plain = _generate(engine)
    assert max(abs(a - b) for a, b in zip(plain[1], quantized[1])) > 1e-3


def _fresh(path: str) -> tuple[list[list[int]], list[float]]:
    with Engine(model_path=path, random_seed=0, quantization="fp8", **MTP) as engine:
        return _generate(engine)


class Pickled:
    """An engine whose update calls' arguments are pickled on the way, as a Ray actor's are."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str):
        method = getattr(self.engine, name)
        return lambda *a, **kw: method(
            *pickle.loads(pickle.dumps(a)), **pickle.loads(pickle.dumps(kw))
        )


@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_updates_equal_a_fresh_fp8_load(pair, mode, tmp_path):
    old, new = pair
    expected = _fresh(new)
    tensors = load_file(os.path.join(new, "model.safetensors"))
    engine = Engine(model_path=old, random_seed=0, quantization="fp8", **MTP)
    try:
        assert _generate(engine) != expected
        cfg = WeightSyncConfig(
            update_weight_buffer_size=100_000, weight_sync_mode=mode, check_weight_update_equal=True
        )
        pusher = WeightPusher([Pickled(engine)], cfg, output_dir=str(tmp_path))
        stats = pusher.push(tensors.items(), version="v1")
        pusher.close()
        assert _generate(engine) == expected
    finally:
        engine.shutdown()
    if mode != "disk":  # FP8 linears with their scales (a quarter of their float32 bytes)
        sent = 0
        for name, t in tensors.items():
            q = quantize(t, DEFAULT_BLOCK) if name.endswith("proj.weight") else None
            fp8 = q is not None and "input_proj" not in name
            sent += t.numel() + q[1].numel() * 4 if fp8 else t.numel() * 4
        assert stats["bytes"] == sent < 0.5 * sum(t.numel() * 4 for t in tensors.values())


def test_unquantized_updates_are_quantized_on_the_way_in(pair):
    """float32 weights sent straight to an FP8 engine (not by the pusher, which quantizes them)
    land as a fresh FP8 load of them; --check-weight-update-equal's comparison holds."""
    old, new = pair
    tensors = load_file(os.path.join(new, "model.safetensors"))
    with Engine(model_path=old, random_seed=0, quantization="fp8", **MTP) as engine:
        engine.update_weights_from_tensor(list(tensors.items()))
        assert _generate(engine) == _fresh(new)
        pusher = WeightPusher([engine], WeightSyncConfig(check_weight_update_equal=True))
        pusher.verify(tensors)
        pusher.close()


def test_an_external_draft_takes_its_updates_as_sent(pair, make_model, tmp_path):
    """A STANDALONE draft, even one loaded from an FP8 release, is not quantized on update: the
    trainer sends it unquantized and --check-weight-update-equal compares it so."""
    src = make_model("qwen2", seed=65)
    draft = to_fp8_release(src, str(tmp_path / "draft-fp8"), DEFAULT_BLOCK)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft)
    with Engine(model_path=pair[0], random_seed=0, quantization="fp8", **spec, **MTP_TREE) as e:
        pusher = WeightPusher([e], WeightSyncConfig(check_weight_update_equal=True))
        pusher.push([("draft." + n, t) for n, t in tensors.items()], version="v1")
        pusher.close()
        assert torch.equal(hf_tensor(e.scheduler.worker.draft.model, DOWN), tensors[DOWN])


def test_fp8_weights_into_an_unquantized_engine_are_refused(pair):
    weight = load_file(os.path.join(pair[1], "model.safetensors"))[DOWN]
    q, s = quantize(weight, DEFAULT_BLOCK)
    with Engine(model_path=pair[0], random_seed=0) as engine:
        with pytest.raises(ValueError, match="start the engine with --quantization fp8"):
            engine.update_weights_from_tensor([(DOWN, q), (scale_name(DOWN), s)])
    with Engine(model_path=pair[0], random_seed=0, quantization="fp8") as engine:
        with pytest.raises(ValueError, match="has no 'model.layers.1.mlp.down_proj.weight_scale"):
            engine.update_weights_from_tensor([(DOWN, q)])


@pytest.mark.parametrize("method", ["awq", "gptq", "w8a8_fp8"])
def test_other_quantization_methods_are_refused(method):
    with pytest.raises(ValueError, match=f"--quantization '{method}' is not supported.*fp8"):
        EngineArgs(model_path="M", quantization=method)


def test_a_block_scale_travels_in_its_weights_bucket():
    """The engine dequantizes an FP8 weight with its scale in one update: no bucket boundary
    falls between them, even where the size would put one."""
    items = [
        ("a.weight", torch.zeros(60, dtype=torch.float8_e4m3fn)),
        ("a.weight_scale_inv", torch.zeros(2)),
        ("b.weight", torch.zeros(60, dtype=torch.float8_e4m3fn)),
    ]
    groups = [[n for n, _ in g] for g in buckets(items, max_bytes=64)]
    assert groups == [["a.weight", "a.weight_scale_inv"], ["b.weight"]]
