"""Model definitions, looked up by the architecture name in config.json."""

from __future__ import annotations

from torch import nn

from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.llama import LlamaForCausalLM

_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MiMoForCausalLM": LlamaForCausalLM,  # the trunk; its MTP layers load as a draft (models/mimo.py)
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    return _MODEL_CLASSES[config.architecture]
