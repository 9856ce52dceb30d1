"""The trainer on checkpoints as the big releases publish them (tiny/releases.py): DeepSeek-V3's
block-FP8 release reads (conversion and --hf-checkpoint) as DeepSeek's reference weight_dequant
computes it, bit for bit (tests/support/fp8_reference.py), and exports as its fp8_cast_bf16.py
BF16 form (or, --keep-fp8, in the FP8 layout it came in); GLM-4.5's and GLM-4.5-Air's next-n
layers with their `embed_tokens` and `shared_head.head` copies, Qwen3 and MiMo, sharded with an
index, go Hugging Face -> megatron -> Hugging Face bit for bit; an EAGLE-3 draft as published
(`d2t`/`t2d`, `pytorch_model.bin`, fewer positions than the policy) trains on longer sequences."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import FAMILIES, GLM45_AIR
from safetensors.torch import load_file

from tests.support.fp8_reference import dequantized_copy, dequantized_tensors, read_shards
from tiny.checkpoints import add_mimo_mtp, build_eagle_draft
from tiny.releases import to_fp8_release, to_sharded_release
from trainer_bridge.convert import (
    hf_to_mcore_state_dict,
    load_mcore_rank,
    read_hf_weights,
)
from trainer_bridge.convert.__main__ import main as convert_cli

pytestmark = [
    pytest.mark.filterwarnings("ignore:::megatron"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU megatron tests"),
]
VOCAB = 300
BLOCK = (16, 16)
# q_lora_rank 40: q_a_proj's rows, q_b_proj's columns and kv_a_proj_with_mqa's rows end in a
# partial block, as DeepSeek-V3's kv_a_proj_with_mqa's 576 rows do in 128-row blocks.
DEEPSEEK_V3 = dict(
    arch="deepseek_v3", extra_config={"num_nextn_predict_layers": 1, "q_lora_rank": 40}
)


@pytest.fixture(scope="module")
def releases(make_model, tmp_path_factory) -> dict[str, str]:
    def out(name: str) -> str:
        return str(tmp_path_factory.mktemp(name))

    mimo = out("mimo-src")
    shutil.copytree(make_model(arch="qwen2", vocab_size=VOCAB), mimo, dirs_exist_ok=True)
    return {
        "deepseek_v3_fp8": to_fp8_release(
            make_model(**DEEPSEEK_V3, vocab_size=VOCAB), out("dsv3-fp8"), BLOCK
        ),
        "glm4_5": to_sharded_release(
            make_model(**FAMILIES["glm4_moe"], vocab_size=VOCAB), out("glm")
        ),
        "glm4_5_air": to_sharded_release(make_model(**GLM45_AIR, vocab_size=VOCAB), out("air")),
        "qwen3": to_sharded_release(make_model(**FAMILIES["qwen3"], vocab_size=VOCAB), out("q3")),
        "mimo": to_sharded_release(add_mimo_mtp(mimo), out("mimo")),
    }


def _convert(src: str, tmp_path, *extra: str) -> str:
    mcore, hf = str(tmp_path / "mcore"), str(tmp_path / "hf")
    convert_cli(["hf-to-mcore", "--hf-checkpoint", src, "--save", mcore])
    convert_cli(["mcore-to-hf", "--load", mcore, "--hf-checkpoint", src, "--save", hf, *extra])
    return mcore


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def test_fp8_release_converts_as_deepseeks_weight_dequant_and_exports_bf16(releases, tmp_path):
    src = releases["deepseek_v3_fp8"]
    reference = dequantized_tensors(src)  # DeepSeek's weight_dequant, float32 out
    read = read_hf_weights(src)
    assert read.keys() == reference.keys()
    assert all(torch.equal(read[k], reference[k]) for k in reference)
    mcore = _convert(src, tmp_path)
    # megatron's tensors are those of the reference's weights (vocab padding aside)
    shard, expected = load_mcore_rank(mcore, 0), hf_to_mcore_state_dict(reference, src)
    assert shard.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(shard[key][: tensor.shape[0]], tensor), key
    mtp = "model.layers.2.self_attn.kv_b_proj.weight"  # the next-n layer's FP8 linears too
    # exported as fp8_cast_bf16.py writes the release: FP8 weights BF16, the rest as stored
    bf16 = dequantized_tensors(src, torch.bfloat16)
    out = read_shards_or_file(str(tmp_path / "hf"))
    assert out.keys() == bf16.keys()
    for name, tensor in bf16.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    assert out[mtp].dtype == torch.bfloat16
    assert out["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    config = _config(str(tmp_path / "hf"))
    assert "quantization_config" not in config
    assert config == {k: v for k, v in _config(src).items() if k != "quantization_config"}


def read_shards_or_file(path: str) -> dict[str, torch.Tensor]:
    if os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        return read_shards(path)
    return load_file(os.path.join(path, "model.safetensors"))


def test_keep_fp8_writes_the_release_layout_back(releases, tmp_path):
    src = releases["deepseek_v3_fp8"]
    _convert(src, tmp_path, "--keep-fp8")
    stored, out = read_shards(src), read_shards_or_file(str(tmp_path / "hf"))
    assert out.keys() == stored.keys()
    for name, tensor in stored.items():
        assert out[name].dtype == tensor.dtype, name
        assert torch.equal(out[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert _config(str(tmp_path / "hf")) == _config(src)


def test_keep_fp8_of_a_bf16_checkpoint_is_refused(releases, tmp_path, capsys):
    with pytest.raises(SystemExit):
        _convert(releases["qwen3"], tmp_path, "--keep-fp8")
    assert "is not block-FP8" in capsys.readouterr().err


def test_train_actor_reads_the_fp8_release(releases, tmp_path):
    """--hf-checkpoint of the FP8 release: the policy's log-probs are transformers' on the
    dequantized weights, and --save-hf writes the BF16 form."""
    from transformers import AutoModelForCausalLM

    from trainer_bridge.actor import TrainActor
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    src = releases["deepseek_v3_fp8"]
    ids = torch.randint(5, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = TrainBatch(ids.tolist(), [4, 4], [1.0, 0.0], n_samples_per_prompt=2)
    actor = TrainActor(TrainerArgs(hf_checkpoint=src, micro_batch_size=1))
    try:
        got = actor.compute_log_probs(batch)
        actor.save_hf(str(tmp_path / "saved"))
    finally:
        destroy_model_parallel()
    oracle = dequantized_copy(src, str(tmp_path / "oracle"))
    model = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits, dim=-1)
    expected = [[logp[b, t - 1, ids[b, t]].item() for t in range(8, 12)] for b in range(2)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-4)
    saved, bf16 = (
        read_shards_or_file(str(tmp_path / "saved")),
        dequantized_tensors(src, torch.bfloat16),
    )
    assert saved.keys() == bf16.keys() and all(torch.equal(saved[k], bf16[k]) for k in bf16)


@pytest.mark.parametrize("name", ["glm4_5", "glm4_5_air", "qwen3", "mimo"])
def test_release_layouts_round_trip_bit_for_bit(releases, name, tmp_path):
    src = releases[name]
    _convert(src, tmp_path)
    original, restored = read_shards(src), read_shards_or_file(str(tmp_path / "hf"))
    assert restored.keys() == original.keys()
    for key, tensor in original.items():
        assert restored[key].dtype == tensor.dtype and torch.equal(restored[key], tensor), key
    if name.startswith("glm"):  # the next-n layer's copies, as released
        assert torch.equal(
            restored["model.layers.3.embed_tokens.weight"], original["model.embed_tokens.weight"]
        )
        assert "model.layers.3.shared_head.head.weight" in restored


def test_a_next_n_copy_that_differs_from_the_trunk_is_refused(releases, tmp_path):
    weights = read_hf_weights(releases["glm4_5"])
    weights["model.layers.3.shared_head.head.weight"] = (
        weights["model.layers.3.shared_head.head.weight"] + 1
    )
    with pytest.raises(ValueError, match="differs from the trunk's"):
        hf_to_mcore_state_dict(weights, releases["glm4_5"])


def test_published_eagle3_draft_trains_past_its_max_positions(make_model, tmp_path):
    """As published (EAGLE3-LLaMA3.1-Instruct-8B: pytorch_model.bin, 2048 positions for a
    131072-position policy): the draft trains on sequences longer than its own
    max_position_embeddings, as the engine runs it."""
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    target = make_model("llama", num_layers=4)
    draft = build_eagle_draft(str(tmp_path / "eagle3"), target, version=3, draft_vocab_size=96)
    tensors = load_file(os.path.join(draft, "model.safetensors"))
    os.remove(os.path.join(draft, "model.safetensors"))
    torch.save(tensors, os.path.join(draft, "pytorch_model.bin"))
    config = _config(draft)
    config["max_position_embeddings"] = 16
    with open(os.path.join(draft, "config.json"), "w") as f:
        json.dump(config, f)
    args = TrainerArgs(
        hf_checkpoint=target, lr=1e-6, enable_draft_training=True, draft_checkpoint=draft
    )
    tokens = torch.randint(5, 500, (2, 24), generator=torch.Generator().manual_seed(1)).tolist()
    actor = TrainActor(args)
    try:
        metrics = actor.train(TrainBatch(tokens, [12, 12], [1.0, 0.0], n_samples_per_prompt=2))
    finally:
        destroy_model_parallel()
    assert torch.isfinite(torch.tensor(metrics["train/draft_loss"]))
