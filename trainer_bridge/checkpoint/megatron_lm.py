"""The model shape of a Megatron-LM checkpoint (slime's torch_dist), read from its tensors' global
shapes in the checkpoint's metadata, so that --ref-load refuses one of another model than
--hf-checkpoint's before Ray starts.

Megatron stacks the layers of a model whose layers are alike under `decoder.layers.*` (the layer
first in every shape) and keeps each layer under its own number, `decoder.layers.<i>.*`, where
dense and MoE layers mix (DeepSeek-V3's and GLM-4.5's first dense layers).
"""

from __future__ import annotations

import re
from typing import Any

from spec_engine.models.hf_config import ModelConfig

Shapes = dict[str, tuple[int, ...]]


def check_megatron_model(directory: str, hf_config: dict[str, Any]) -> None:
    """Refuse a Megatron-LM checkpoint of another model than --hf-checkpoint's: its hidden size,
    layers, dense MLP width, routed experts and (padded) vocabulary, read from its tensors' global
    shapes."""
    shapes = _tensor_shapes(directory)
    arch = ModelConfig.load(hf_config)
    embedding = shapes.get("embedding.word_embeddings.weight")
    layers = _per_layer(shapes, "self_attention.linear_proj.weight")
    if embedding is None or not layers:
        raise ValueError(
            f"{directory} holds no GPT model's embedding and decoder layers (megatron torch_dist "
            "keys embedding.word_embeddings.weight, decoder.layers.*); point --ref-load at a "
            "checkpoint of the policy's model"
        )
    diffs = _differences(shapes, embedding, len(layers), arch)
    if diffs:
        raise ValueError(
            f"{directory} holds another model than --hf-checkpoint ({', '.join(diffs)}); point "
            "--ref-load at a checkpoint of the policy's model"
        )


def _tensor_shapes(directory: str) -> Shapes:
    """Every tensor's global shape in the torch_dist checkpoint at `directory`, by its key."""
    from torch.distributed.checkpoint import FileSystemReader

    return {
        key: tuple(meta.size)
        for key, meta in FileSystemReader(directory).read_metadata().state_dict_metadata.items()
        if hasattr(meta, "size")
    }


def _per_layer(shapes: Shapes, name: str) -> dict[int, tuple[int, ...]]:
    """Layer number -> shape of one layer's tensor `name`, stacked or numbered."""
    if (stacked := shapes.get(f"decoder.layers.{name}")) is not None:
        return {i: stacked[1:] for i in range(stacked[0])}
    pattern = re.compile(rf"decoder\.layers\.(\d+)\.{re.escape(name)}")
    return {int(m[1]): shape for key, shape in shapes.items() if (m := pattern.fullmatch(key))}


def _differences(
    shapes: Shapes, embedding: tuple[int, ...], num_layers: int, arch: ModelConfig
) -> list[str]:
    """What differs between the checkpoint's model (`shapes`, its word embedding's shape and layer
    count) and `arch`, as "<what> <found> vs <wanted>"; empty when they agree."""
    # gate and up projections stacked in a dense MLP's linear_fc1; a router's rows, its experts
    dense = {shape[0] // 2 for shape in _per_layer(shapes, "mlp.linear_fc1.weight").values()}
    experts = {shape[0] for shape in _per_layer(shapes, "mlp.router.weight").values()}
    found = {
        "hidden size": embedding[1],
        "layers": num_layers,
        "intermediate size": dense or None,
        "routed experts": experts or None,
    }
    wanted = {
        "hidden size": arch.hidden_size,
        "layers": arch.num_hidden_layers,
        "intermediate size": {arch.intermediate_size} if dense else None,
        "routed experts": {arch.moe.num_experts} if arch.moe else None,
    }
    diffs = [
        f"{name} {_shown(found[name])} vs {_shown(wanted[name])}"
        for name in found
        if found[name] != wanted[name]
    ]
    if embedding[0] < arch.vocab_size:
        diffs.append(f"vocabulary {embedding[0]} vs at least {arch.vocab_size}")
    return diffs


def _shown(value: Any) -> Any:
    """A set of one value as that value (a layer-wise width all layers share), else as it is."""
    return next(iter(value)) if isinstance(value, set) and len(value) == 1 else value
