"""Whole (tensor-parallel size 1) state dicts between Hugging Face and megatron, for every
trainable architecture: each family's layout module (llama.py, glm4_moe.py, deepseek_v3.py)
names the tensors (and those a checkpoint may lack) and fuses or splits them; this module picks
the layout and checks that nothing is missing or left over."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import ModuleType

from torch import Tensor

from spec_engine.models.hf_config import ModelConfig
from trainer_bridge.convert import deepseek_v3, glm4_moe, llama

# ModelConfig.family -> layout module (name_map, to_mcore, to_hf); Llama's by default.
_LAYOUTS: dict[str, ModuleType] = {"glm4_moe": glm4_moe, "deepseek_v3": deepseek_v3}


def layout(arch: ModelConfig) -> ModuleType:
    """The module that lays out `arch`'s tensors."""
    return _LAYOUTS.get(arch.family, llama)


def name_map(arch: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Every megatron parameter name of `arch`, with the Hugging Face tensors it is made of, in HF
    order."""
    return layout(arch).name_map(arch)


def hf_to_mcore_state_dict(
    hf_tensors: Mapping[str, Tensor], arch: ModelConfig
) -> dict[str, Tensor]:
    """The whole (TP=1, unpadded vocab) megatron state dict of a Hugging Face state dict."""
    family = layout(arch)
    names = family.name_map(arch)
    wanted = {h for hs in names.values() for h in hs}
    missing = sorted(wanted - hf_tensors.keys() - set(family.optional_names(arch)))
    unexpected = sorted(hf_tensors.keys() - wanted)
    if missing or unexpected:
        raise ValueError(
            f"{arch.architecture} checkpoint does not match its config: missing tensors "
            f"{missing[:5]} "
            f"({len(missing)} in all), unexpected tensors {unexpected[:5]} ({len(unexpected)} in "
            "all)"
        )
    return {
        m: family.to_mcore(m, tuple(hf_tensors[h] for h in hs if h in hf_tensors), arch)
        for m, hs in names.items()
    }


def mcore_to_hf_items(
    state: Mapping[str, Tensor], arch: ModelConfig
) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, tensor) pairs of a whole megatron state dict, one megatron tensor at a
    time."""
    family = layout(arch)
    mapping = family.name_map(arch)
    # model.state_dict() also holds `*._extra_state` entries (None without Transformer Engine).
    # Values are read only inside the loop: `state` may produce them lazily (gathered over TP).
    names = {k for k in state if not k.endswith("._extra_state")}
    missing = [m for m in mapping if m not in names]
    unexpected = sorted(names - mapping.keys())
    if missing or unexpected:
        raise ValueError(
            f"megatron state dict does not match {arch.architecture}: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all)"
        )
    for m, hf_names in mapping.items():
        for h, t in zip(hf_names, family.to_hf(m, state[m].detach(), arch)):
            yield h, t.contiguous()
