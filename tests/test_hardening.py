"""Hostile input that must not corrupt a running engine: non-finite weight updates are refused
naming the tensor and leave the weights bitwise as they were; NaN logits are caught by
--enable-nan-detection."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spec_engine import Engine

NAME = "model.layers.0.mlp.down_proj.weight"
REQUEST = dict(input_ids=[5, 6, 7, 8], sampling_params={"temperature": 0, "max_new_tokens": 6})


@pytest.fixture(scope="module")
def path(make_model) -> str:
    return make_model("llama", max_position_embeddings=256)


def test_non_finite_weight_updates_are_refused(path, tmp_path):
    with Engine(model_path=path, random_seed=0, max_total_tokens=1024) as engine:
        before = engine.get_weights_checksum()
        greedy = engine.generate(**REQUEST)["output_ids"]
        good = load_file(f"{path}/model.safetensors")
        for bad_value in (float("nan"), float("inf")):
            tensors = {k: v.clone() for k, v in good.items()}
            tensors[NAME][3, 1] = bad_value
            with pytest.raises(ValueError, match=f"weight '{NAME}' has non-finite values"):
                engine.update_weights_from_tensor(list(tensors.items()))
        bad_dir = tmp_path / "bad"
        shutil.copytree(path, bad_dir)
        save_file(tensors, str(bad_dir / "model.safetensors"))
        with pytest.raises(ValueError, match="non-finite values"):
            engine.update_weights_from_disk(str(bad_dir))
        assert engine.get_weights_checksum() == before
        assert engine.generate(**REQUEST)["output_ids"] == greedy


def test_nan_detection_keeps_sampling(path, caplog):
    """--enable-nan-detection: NaN logits (here: a NaN weight row in the LM head) are logged,
    and the request still gets valid tokens."""
    with Engine(
        model_path=path, random_seed=0, max_total_tokens=1024, enable_nan_detection=True
    ) as engine:
        head = engine.runner.model.lm_head.weight
        with torch.no_grad():
            head.data[7].fill_(float("nan"))
        engine.runner.model.lm_head.refresh_derived()
        with caplog.at_level(logging.WARNING, logger="spec_engine.core.logits_processor"):
            out = engine.generate(**REQUEST, return_logprob=True)
        assert len(out["output_ids"]) == 6 and 7 not in out["output_ids"]
        assert "NaN in the logits" in caplog.text
