"""The model class for a checkpoint, looked up by the architecture name in its config.json."""

from __future__ import annotations

from torch import nn

from spec_engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from spec_engine.models.deepseek_v3_nextn import DeepseekV3NextN
from spec_engine.models.glm4_moe import Glm4MoeForCausalLM
from spec_engine.models.glm4_moe_nextn import Glm4MoeNextN
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.llama import LlamaForCausalLM
from spec_engine.models.llama_eagle import LlamaForCausalLMEagle
from spec_engine.models.llama_eagle3 import LlamaForCausalLMEagle3
from spec_engine.models.mimo import MiMoMTP

_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MiMoForCausalLM": LlamaForCausalLM,  # the trunk; its MTP layers are mtp_class's
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLMEagle": LlamaForCausalLMEagle,
    "LlamaForCausalLMEagle3": LlamaForCausalLMEagle3,
}
# Targets whose checkpoints carry multi-token-prediction layers, and the module that runs them.
_MTP_CLASSES: dict[str, type[nn.Module]] = {
    "MiMoForCausalLM": MiMoMTP,
    "Glm4MoeForCausalLM": Glm4MoeNextN,
    "DeepseekV3ForCausalLM": DeepseekV3NextN,
}
# MTP modules that run several next-n layers, one per draft step (--enable-multi-layer-eagle).
_MULTI_LAYER_MTP = (DeepseekV3NextN,)


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The class of a target model or of an EAGLE/EAGLE-3 draft."""
    return _MODEL_CLASSES[config.architecture]


def mtp_class(config: ModelConfig) -> type[nn.Module]:
    """The draft module over a target's MTP layers."""
    cls = _MTP_CLASSES.get(config.architecture)
    if cls is None:
        raise ValueError(
            f"{config.architecture} has no MTP layers specrl can draft with; supported: "
            f"{', '.join(_MTP_CLASSES)}"
        )
    return cls


def multi_layer_mtp(config: ModelConfig) -> bool:
    """Whether the target's MTP module can run a different next-n layer at each draft step."""
    return _MTP_CLASSES.get(config.architecture) in _MULTI_LAYER_MTP
