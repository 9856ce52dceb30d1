"""trainer_bridge.convert and trainer_bridge.model.provider against transformers: megatron
GPTModel logits equal the Hugging Face model's (TP=1 in process, TP=2 in two spawned gloo ranks),
MiMo's MTP layer equals the engine's formula built from transformers' Qwen2 layer, and Hugging
Face -> megatron -> Hugging Face reproduces every tensor bit for bit."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import FAMILIES
from torch.nn import functional as F

from tests.support.forkserver import start_ranks
from tiny.checkpoints import add_mimo_mtp
from trainer_bridge.convert import (
    hf_to_mcore,
    hf_to_mcore_state_dict,
    load_hf_weights,
    load_mcore_rank,
    load_mcore_state_dict,
    mcore_to_hf,
    mcore_to_hf_tensors,
    read_hf_weights,
    read_mcore_meta,
)
from trainer_bridge.convert.__main__ import main as convert_cli
from trainer_bridge.model.provider import padded_vocab_size, read_model_config

# megatron's notices about absent Transformer Engine/apex and its own deprecations: not ours to fix.
pytestmark = [
    pytest.mark.filterwarnings("ignore:::megatron"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning"),
]
# The megatron models here run on CPU with the shims (on a CUDA machine they would build on the
# GPU).
cpu_megatron = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU megatron tests")
NAMES = ("llama", "qwen2", "qwen3")
VOCAB = 300  # not a multiple of 128: megatron pads it to 384 (TP=1) or 512 (TP=2)
T = 12
ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(make_model, tmp_path_factory) -> dict[str, str]:
    """Tiny llama (llama3 rope), qwen2 (tied), qwen3 (qk-norm, head_dim 32), MiMo (untied qwen2
    + 1 MTP layer), GLM-4.5 MoE and DeepSeek-V3 (only in the TP=2 test here;
    tests/trainer/test_trainer_moe.py has the rest)."""
    paths = {name: make_model(**FAMILIES[name], vocab_size=VOCAB) for name in NAMES}
    # Routed and shared experts (and DeepSeek-V3's MLA projections) split over TP ranks; no next-n
    # layers, which would need labels to run.
    paths["glm4_moe"] = make_model(
        arch="glm4_moe", vocab_size=VOCAB, extra_config={"num_nextn_predict_layers": 0}
    )
    paths["deepseek_v3"] = make_model(arch="deepseek_v3", vocab_size=VOCAB)
    mimo = str(tmp_path_factory.mktemp("mimo"))
    shutil.copytree(make_model(arch="qwen2", vocab_size=VOCAB), mimo, dirs_exist_ok=True)
    paths["mimo"] = add_mimo_mtp(mimo)
    return paths


def _ids() -> torch.Tensor:
    return torch.randint(5, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))


def _positions() -> torch.Tensor:
    return torch.arange(T).expand(2, T)


@torch.no_grad()
def hf_logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(_ids()).logits


@torch.no_grad()
def mimo_mtp_reference(path: str) -> torch.Tensor:
    """MiMo's MTP layer 0 output `[b, s, h]` as spec_engine/models/mimo.py computes it, from
    transformers'
    Qwen2 modules: input_proj([hidden_layernorm(final hidden), token_layernorm(embedding of the next
    token)]), one Qwen2 decoder layer, final_layernorm. Inputs are aligned as megatron's MTP
    training
    aligns them (position i reads token i+1; the last reads token 0); the engine's extra zeroing of
    the position-0 embedding is an inference-time rule this does not model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for key in ("architectures", "model_type", "num_nextn_predict_layers", "layer_types"):
        cfg.pop(key)
    weights = read_hf_weights(path)
    mtp = {
        k[len("model.mtp_layers.0.") :]: v
        for k, v in weights.items()
        if k.startswith("model.mtp_layers.0.")
    }
    trunk = Qwen2ForCausalLM(Qwen2Config(**cfg)).eval()
    trunk.load_state_dict({k: v for k, v in weights.items() if "mtp_layers" not in k})
    layer = Qwen2Model(Qwen2Config(**{**cfg, "num_hidden_layers": 1})).eval()
    layer.load_state_dict(
        {
            "embed_tokens.weight": weights["model.embed_tokens.weight"],
            "norm.weight": mtp["final_layernorm.weight"],
            **{
                f"layers.0.{k}": v
                for k, v in mtp.items()
                if k.startswith(("self_attn", "mlp", "input_l", "post_"))
            },
        }
    )
    ids = _ids()
    hidden = trunk.model(ids).last_hidden_state
    next_ids = torch.roll(ids, -1, dims=1)
    next_ids[:, -1] = 0
    h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
    x = torch.cat(
        (
            F.rms_norm(hidden, (h,), mtp["hidden_layernorm.weight"], eps),
            F.rms_norm(
                trunk.model.embed_tokens(next_ids), (h,), mtp["token_layernorm.weight"], eps
            ),
        ),
        dim=-1,
    )
    return layer(inputs_embeds=x @ mtp["input_proj.weight"].T).last_hidden_state


@torch.no_grad()
def megatron_logits(model) -> torch.Tensor:
    """Logits `[b, s, padded vocab]`, gathered over tensor-parallel ranks."""
    return model(_ids(), _positions(), None, runtime_gather_output=True)


@torch.no_grad()
def megatron_mtp_output(model) -> torch.Tensor:
    """The MTP block's layer-0 output `[b, s, h]` (the block only runs when labels are given)."""
    captured = []
    hook = model.mtp.layers[0].register_forward_hook(
        lambda module, args, out: captured.append(out[0])
    )
    model(_ids(), _positions(), None, labels=_ids())
    hook.remove()
    return captured[0].transpose(0, 1)


@pytest.fixture
def tp1():
    from trainer_bridge.megatron_compat import model_parallel

    with model_parallel(1, 1):
        yield


@cpu_megatron
@pytest.mark.parametrize("family", NAMES)
def test_logits_match_transformers_tp1(family, checkpoints, tp1):
    from trainer_bridge.model.provider import build_gpt_model

    path = checkpoints[family]
    model = build_gpt_model(path).eval()
    load_hf_weights(model, path)
    logits = megatron_logits(model)
    assert logits.shape == (2, T, padded_vocab_size(VOCAB, 1))
    torch.testing.assert_close(logits[..., :VOCAB], hf_logits(path), rtol=0, atol=ATOL)
    # The model's own state dict exports back to exactly the checkpoint's tensors.
    exported = dict(mcore_to_hf_tensors(model, path))
    original = read_hf_weights(path)
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


@cpu_megatron
def test_mimo_mtp_block_matches_reference_tp1(checkpoints, tp1):
    from trainer_bridge.model.provider import build_gpt_model

    model = build_gpt_model(checkpoints["mimo"]).eval()
    assert model.config.mtp_num_layers == 1
    load_hf_weights(model, checkpoints["mimo"])
    mtp_out = megatron_mtp_output(model)
    torch.testing.assert_close(mtp_out, mimo_mtp_reference(checkpoints["mimo"]), rtol=0, atol=ATOL)


def _tp2_worker(rank: int, port: int, jobs: dict[str, tuple[str, str]], out_dir: str) -> None:
    """One of two gloo ranks: load its shard of each megatron checkpoint; rank 0 saves the gathered
    outputs and the model exported to Hugging Face tensors."""
    torch.set_num_threads(1)
    from trainer_bridge.megatron_compat import model_parallel
    from trainer_bridge.model.provider import build_gpt_model

    with model_parallel(2, 1, rank=rank, world_size=2, master_port=port):
        for name, (hf_path, mcore_path) in jobs.items():
            model = build_gpt_model(hf_path).eval()
            load_mcore_state_dict(model, load_mcore_rank(mcore_path, rank))
            output = megatron_mtp_output(model) if name == "mimo" else megatron_logits(model)
            exported = dict(mcore_to_hf_tensors(model, hf_path))  # collective: both ranks gather
            if rank == 0:
                torch.save((output, exported), os.path.join(out_dir, f"{name}.pt"))


@cpu_megatron
def test_tp2_logits_mtp_and_export_match(checkpoints, tmp_path):
    from trainer_bridge.megatron_compat import free_port

    jobs = {}
    for name, path in checkpoints.items():
        hf_to_mcore(path, str(tmp_path / f"{name}-tp2"), tp=2)
        jobs[name] = (path, str(tmp_path / f"{name}-tp2"))
    start_ranks(_tp2_worker, (free_port(), jobs, str(tmp_path)), 2)
    for name, path in checkpoints.items():
        output, exported = torch.load(tmp_path / f"{name}.pt")
        original = read_hf_weights(path)
        assert exported.keys() == original.keys()
        assert all(torch.equal(exported[k], original[k]) for k in original), name
        if name == "mimo":
            expected = mimo_mtp_reference(path)
        else:
            assert output.shape == (2, T, padded_vocab_size(VOCAB, 2))
            output, expected = output[..., :VOCAB], hf_logits(path)
        torch.testing.assert_close(output, expected, rtol=0, atol=ATOL, msg=name)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", [*NAMES, "mimo"])
def test_roundtrip_is_bit_exact(name, tp, checkpoints, tmp_path):
    src = checkpoints[name]
    convert_cli(
        ["hf-to-mcore", "--hf-checkpoint", src, "--save", str(tmp_path / "mcore"), "--tp", str(tp)]
    )
    convert_cli(
        [
            "mcore-to-hf",
            "--load",
            str(tmp_path / "mcore"),
            "--hf-checkpoint",
            src,
            "--save",
            str(tmp_path / "hf"),
        ]
    )
    meta = read_mcore_meta(str(tmp_path / "mcore"))
    assert meta["tensor_model_parallel_size"] == tp and meta[
        "padded_vocab_size"
    ] == padded_vocab_size(VOCAB, tp)
    shard = load_mcore_rank(str(tmp_path / "mcore"), tp - 1)
    assert shard["embedding.word_embeddings.weight"].shape[0] == padded_vocab_size(VOCAB, tp) // tp
    original, restored = read_hf_weights(src), read_hf_weights(str(tmp_path / "hf"))
    assert restored.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(restored[key], tensor), key
    for entry in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(src, entry), "rb") as a, open(tmp_path / "hf" / entry, "rb") as b:
            assert a.read() == b.read(), entry


def test_mtp_eh_proj_reads_embedding_then_hidden(checkpoints):
    weights = read_hf_weights(checkpoints["mimo"])
    state = hf_to_mcore_state_dict(weights, checkpoints["mimo"])
    input_proj = weights["model.mtp_layers.0.input_proj.weight"]
    h = input_proj.shape[0]
    assert torch.equal(
        state["mtp.layers.0.eh_proj.weight"],
        torch.cat((input_proj[:, h:], input_proj[:, :h]), dim=1),
    )


def test_errors_name_the_bad_value(checkpoints, tmp_path, capsys):
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        read_model_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with open(os.path.join(checkpoints["qwen2"], "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises(ValueError, match="'yarn'"):
        read_model_config(
            {**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}
        )
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        hf_to_mcore(checkpoints["qwen2"], str(tmp_path / "tp4"), tp=4)
    weights = read_hf_weights(checkpoints["qwen3"])
    weights.pop("model.layers.1.self_attn.q_norm.weight")
    with pytest.raises(
        ValueError, match=r"missing tensors \['model.layers.1.self_attn.q_norm.weight'\]"
    ):
        hf_to_mcore_state_dict(weights, checkpoints["qwen3"])
    hf_to_mcore(checkpoints["qwen2"], str(tmp_path / "qwen2"))
    with pytest.raises(ValueError, match="different architecture"):
        mcore_to_hf(str(tmp_path / "qwen2"), checkpoints["qwen3"], str(tmp_path / "out"))
    with pytest.raises(SystemExit):
        convert_cli(
            [
                "mcore-to-hf",
                "--load",
                str(tmp_path / "nothing"),
                "--hf-checkpoint",
                checkpoints["qwen2"],
                "--save",
                str(tmp_path / "out"),
            ]
        )
    assert "nothing' is not a specrl megatron checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert_cli(
            ["hf-to-mcore", "--hf-checkpoint", checkpoints["qwen2"], "--save", str(tmp_path / "e")]
            + ["--ep", "2"]
        )
    assert "--expert-model-parallel-size 2 splits MoE experts" in capsys.readouterr().err
    with pytest.raises(
        ValueError, match="expert-parallel rank 1 is outside .* expert-parallel size 1"
    ):
        load_mcore_rank(str(tmp_path / "qwen2"), 0, 1)


def test_arch_from_a_transformers_config_equals_from_the_directory(checkpoints):
    from transformers import AutoConfig

    for name in NAMES:
        arch = read_model_config(checkpoints[name])
        assert read_model_config(AutoConfig.from_pretrained(checkpoints[name])) == arch
    qwen3 = read_model_config(checkpoints["qwen3"])
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias) == (32, True, False)
    assert read_model_config(checkpoints["mimo"]).num_mtp_layers == 1
