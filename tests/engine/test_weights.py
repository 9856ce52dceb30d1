"""Weight loading: the Hugging Face name map, refusal of bad tensors, derived copies kept in
step."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spec_engine import Engine
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.registry import model_class
from spec_engine.weights.loader import check_weights, copy_weights, load_checkpoint


def load(path: str) -> torch.nn.Module:
    config = ModelConfig.from_pretrained(path)
    model = model_class(config)(config)
    load_checkpoint(model, path)
    return model


def test_every_parameter_is_covered_by_the_weight_spec(family_path):
    model = load(family_path)
    covered = {slot.param for slot in model.hf_weight_spec().values() if slot.param is not None}
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert params == covered


def test_derived_copies_follow_weight_changes_including_a_tied_head(make_model):
    path = make_model("qwen2", tie_word_embeddings=True)
    model = load(path)
    x = torch.randn(5, model.config.hidden_size)
    new_embed = torch.randn(model.config.vocab_size, model.config.hidden_size)
    copy_weights(model, [("model.embed_tokens.weight", new_embed)])
    with torch.no_grad():
        assert torch.allclose(model.lm_head(x), x @ new_embed.t(), atol=1e-4)
        assert torch.allclose(model.lm_head(x[:1]), x[:1] @ new_embed.t(), atol=1e-4)
        assert torch.equal(model.model.embed_tokens(torch.tensor([3])), new_embed[3:4])
    new_up = torch.randn(model.config.intermediate_size, model.config.hidden_size)
    copy_weights(model, [("model.layers.1.mlp.up_proj.weight", new_up)])
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        fused = mlp.gate_up_proj(x)[:, model.config.intermediate_size :]
    assert torch.allclose(fused, x @ new_up.t(), atol=1e-4)


@pytest.mark.parametrize(
    "mutation,needle",
    [
        ("drop", "missing weights"),
        ("rename", "unknown weight"),
        ("reshape", "has shape"),
        ("int", "floating-point"),
    ],
)
def test_bad_checkpoints_are_refused_by_name(make_model, tmp_path, mutation, needle):
    src = make_model("llama")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    if mutation == "drop":
        del tensors[name]
    elif mutation == "rename":
        tensors["model.layers.0.mlp.bogus.weight"] = tensors.pop(name)
    elif mutation == "reshape":
        tensors[name] = tensors[name][:, :-1].contiguous()
    else:
        tensors[name] = tensors[name].to(torch.int32)
    for f in os.listdir(src):
        if f != "model.safetensors":
            os.link(os.path.join(src, f), tmp_path / f)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=needle):
        Engine(model_path=str(tmp_path))


def test_check_weights_validates_before_copying(make_model):
    model = load(make_model("llama"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        check_weights(model, [("lm_head.weight", (3, 3), "F32")])


def test_checkpoint_files_are_regular_files_inside_the_directory(llama_path, tmp_path):
    """A FIFO named model.safetensors (reading it would block forever), an index entry outside
    the directory, and a truncated file are errors naming the file."""
    from spec_engine.weights.loader import checkpoint_files, iterate_checkpoint

    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors' is not a regular file"):
        checkpoint_files(str(fifo_dir))
    escape = tmp_path / "escape"
    escape.mkdir()
    (escape / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../fifo/model.safetensors"}})
    )
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        checkpoint_files(str(escape))
    truncated = tmp_path / "truncated"
    shutil.copytree(llama_path, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="could not read the weights file .*model.safetensors"):
        list(iterate_checkpoint(str(truncated)))
