"""The trainer's checkpoints name each layer's norm weights as megatron-core's Transformer Engine
spec does (what slime's DeepSeek-V3 and GLM-4.5 torch_dist checkpoints hold): a norm fused into
the linear after it is that linear's `layer_norm_weight` (trainer_bridge.model.checkpoint_names).
The oracle is megatron-core's own TE layer specs (get_gpt_decoder_block_spec /
get_gpt_mtp_block_spec with use_transformer_engine=True), built here from the stand-ins megatron
substitutes for TE's classes when TE is not installed: which of a layer's norms are TENorm modules
and which linears are TELayerNormColumnParallelLinear (a norm fused in)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import FAMILIES

pytestmark = [
    pytest.mark.filterwarnings("ignore:::megatron"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU megatron tests"),
]
# MLA with and without a query bottleneck, GQA with and without q/k norms; a dense first layer
# then MoE, each with a next-n (MTP) layer
VARIANTS = {
    "deepseek_v3": dict(arch="deepseek_v3", extra_config={"num_nextn_predict_layers": 1}),
    "deepseek_v3_no_q_lora": dict(
        arch="deepseek_v3", extra_config={"num_nextn_predict_layers": 1, "q_lora_rank": None}
    ),
    "glm4_moe": FAMILIES["glm4_moe"],
    "glm4_moe_no_qk_norm": dict(arch="glm4_moe", extra_config={"use_qk_norm": False}),
}
NORM = re.compile(r".*(norm\.weight|layer_norm_weight)")


@pytest.fixture
def te_specs(monkeypatch):
    """megatron-core's TE spec builders, runnable without TE: the names gpt_layer_specs imports
    only when TE is installed, bound to megatron's stand-ins, and TE's version check passed."""
    from megatron.core.extensions import transformer_engine, transformer_engine_spec_provider
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(gpt_layer_specs, "TENorm", transformer_engine.TENorm, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TEFusedMLP", None, raising=False)
    monkeypatch.setattr(
        gpt_layer_specs,
        "TESpecProvider",
        transformer_engine_spec_provider.TESpecProvider,
        raising=False,
    )
    for module in (gpt_layer_specs, transformer_engine_spec_provider):
        monkeypatch.setattr(module, "is_te_min_version", lambda *a, **k: True)
    return gpt_layer_specs, transformer_engine_spec_provider


def te_norm_names(node, provider, path: str = "") -> set[str]:
    """The norm weights a TE layer spec's modules hold, by their state-dict names."""
    from megatron.core.extensions.transformer_engine import TENorm

    names: set[str] = set()
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return names
    for field in dataclasses.fields(node):
        if field.name in ("module", "params", "sharded_state_dict_keys_map"):
            continue
        value = getattr(node, field.name)
        name = path if field.name == "submodules" else f"{path}{field.name}."
        if value is provider.TELayerNormColumnParallelLinear:
            names.add(f"{name}layer_norm_weight")
        elif value is TENorm:
            names.add(f"{name}weight")
        else:
            names |= te_norm_names(value, provider, name)
    return names


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_layer_norms_are_saved_under_transformer_engines_names(variant, make_model, te_specs):
    from spec_engine.models.hf_config import ModelConfig
    from trainer_bridge.megatron_compat import model_parallel
    from trainer_bridge.model.provider import build_gpt_model, transformer_config

    specs, provider = te_specs
    path = make_model(**VARIANTS[variant], vocab_size=300)
    config = transformer_config(ModelConfig.load(path))
    with model_parallel(1, 1):
        block = specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm"
        )
        (mtp_layer,) = specs.get_gpt_mtp_block_spec(
            config, block, use_transformer_engine=True
        ).layer_specs
        keys = [
            t.key for t in build_gpt_model(path).sharded_state_dict().values() if hasattr(t, "key")
        ]
    norms = [key for key in keys if NORM.fullmatch(key)]

    def ours(prefix: str) -> set[str]:
        return {key[len(prefix) :] for key in norms if key.startswith(prefix)}

    def theirs(layer) -> set[str]:
        names = te_norm_names(layer, provider)
        if config.multi_latent_attention and config.q_lora_rank is None:
            # MLASelfAttention builds linear_q_proj instead of the query's down and up projections
            names.discard("self_attention.linear_q_up_proj.layer_norm_weight")
        return names

    layers = block.layer_specs
    assert ours("decoder.layers.0.") != ours(f"decoder.layers.{len(layers) - 1}.")  # dense, MoE
    for i, layer in enumerate(layers):
        assert ours(f"decoder.layers.{i}.") == theirs(layer), i
    assert ours("mtp.layers.0.transformer_layer.") == theirs(mtp_layer.submodules.transformer_layer)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_dense_models_norms_keep_transformer_engines_names(family, make_model, te_specs):
    """Dense GQA layers (Qwen3: q/k norms), stacked under `decoder.layers.`: megatron's local
    spec already maps their norms onto TE's names, and the trainer's map keeps that."""
    from spec_engine.models.hf_config import ModelConfig
    from trainer_bridge.megatron_compat import model_parallel
    from trainer_bridge.model.provider import build_gpt_model, transformer_config

    specs, provider = te_specs
    path = make_model(**FAMILIES[family], vocab_size=300)
    config = transformer_config(ModelConfig.load(path))
    layer = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    with model_parallel(1, 1):
        keys = [t.key for t in build_gpt_model(path).sharded_state_dict().values()]
    ours = {k.removeprefix("decoder.layers.") for k in keys if NORM.fullmatch(k)}
    assert ours - {"decoder.final_layernorm.weight"} == te_norm_names(layer, provider)
    assert ("self_attention.q_layernorm.weight" in ours) == (family == "qwen3")


# Transformer Engine's modules that save an `_extra_state` (fp8 metadata; TEDotProductAttention's
# own sharded_state_dict leaves its out, but megatron's MTP block also walks its layers' plain
# state_dict, which keeps it there: MultiTokenPredictionBlock.sharded_state_dict)
TE_STATEFUL = (
    "TENorm",
    "TELinear",
    "TEColumnParallelLinear",
    "TERowParallelLinear",
    "TELayerNormColumnParallelLinear",
)


def te_extra_states_of(node, path: str = "", attention: bool = False) -> set[str]:
    """The `_extra_state` objects a TE-built model of this spec asks a checkpoint for, by their
    state-dict names (`attention`: TEDotProductAttention's too), routed experts left out (their
    SequentialMLP/TEGroupedMLP keys are megatron's own, interchangeable)."""
    from megatron.core.extensions import transformer_engine as te

    kinds = {getattr(te, name) for name in TE_STATEFUL}
    if attention:
        kinds.add(te.TEDotProductAttention)
    names: set[str] = set()
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return names
    for field in dataclasses.fields(node):
        if field.name in ("module", "params", "sharded_state_dict_keys_map", "experts"):
            continue
        value = getattr(node, field.name)
        name = path if field.name == "submodules" else f"{path}{field.name}."
        if any(getattr(value, "module", value) is kind for kind in kinds):
            names.add(f"{name}_extra_state")
        else:
            names |= te_extra_states_of(value, name, attention)
    return names


@pytest.mark.parametrize("variant", sorted(VARIANTS) + ["qwen2", "qwen3"])
def test_modules_save_the_extra_state_transformer_engines_do(variant, make_model, te_specs):
    """Every `_extra_state` a model built with megatron's TE spec asks a checkpoint for is there
    (Megatron-LM with TE, slime, then loads these checkpoints at its default
    --dist-ckpt-strictness): the norms TE builds as TENorm, MLA's key/value down projection
    (TELinear), the MTP layer's attention."""
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from spec_engine.models.hf_config import ModelConfig
    from trainer_bridge.megatron_compat import model_parallel
    from trainer_bridge.model.provider import build_gpt_model, transformer_config

    specs, _ = te_specs
    path = make_model(**VARIANTS.get(variant, FAMILIES.get(variant)), vocab_size=300)
    config = transformer_config(ModelConfig.load(path))
    with model_parallel(1, 1):
        if config.num_moe_experts:
            block = specs.get_gpt_decoder_block_spec(
                config, use_transformer_engine=True, normalization="RMSNorm"
            )
        else:  # what TransformerBlock makes of a layer spec, its final norm TENorm under TE
            layer = specs.get_gpt_layer_with_transformer_engine_spec(
                qk_layernorm=config.qk_layernorm
            )
            block = TransformerBlockSubmodules([layer] * config.num_layers, TENorm)
        mtp = config.mtp_num_layers and specs.get_gpt_mtp_block_spec(
            config, block, use_transformer_engine=True
        )
        keys = [t.key for t in build_gpt_model(path).sharded_state_dict().values()]
    ours = {k for k in keys if k.endswith("._extra_state") and ".experts." not in k}
    # MLASelfAttention builds linear_q_proj or, with a query bottleneck, the down and up projections
    q_lora = getattr(config, "q_lora_rank", None)  # an MLATransformerConfig's
    unbuilt = ("linear_q_proj.",) if q_lora else ("linear_q_down_proj.", "linear_q_up_proj.")

    def theirs(spec, prefix: str, attention: bool = False) -> set[str]:
        names = te_extra_states_of(spec, attention=attention)
        if config.multi_latent_attention:
            names = {
                n for n in names if not n.startswith(tuple(f"self_attention.{u}" for u in unbuilt))
            }
        return {prefix + name for name in names}

    want = {"decoder.final_layernorm._extra_state"}
    for i, layer in enumerate(block.layer_specs):  # MoE models' layers numbered, dense stacked
        want |= theirs(
            layer, f"decoder.layers.{i}." if config.num_moe_experts else "decoder.layers."
        )
    if mtp:
        (mtp_layer,) = mtp.layer_specs
        layer = mtp_layer.submodules.transformer_layer
        own = dataclasses.replace(mtp_layer.submodules, transformer_layer=None)
        # the MTP layer's `layer_norm` spec builds its `final_layernorm`
        want |= {
            n.replace(".layer_norm.", ".final_layernorm.") for n in theirs(own, "mtp.layers.0.")
        }
        want |= theirs(layer, "mtp.layers.0.transformer_layer.", attention=True)
    assert ours == want


# Norms a checkpoint of the local spec names otherwise than TE's, model and Adam's state: MLA's q
# norm and a dense MLA layer's pre-MLP norm; a GQA MoE layer's pre-MLP norm.
LOCAL_KEYS = {
    "deepseek_v3": (
        "decoder.layers.1.self_attention.q_layernorm.weight",
        "optimizer.state.exp_avg.decoder.layers.0.pre_mlp_layernorm.weight",
    ),
    "glm4_moe": (
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
        "optimizer.state.exp_avg.decoder.layers.2.mlp.linear_fc1.layer_norm_weight",
    ),
}


@pytest.mark.parametrize("variant", sorted(LOCAL_KEYS))
def test_a_checkpoint_under_the_local_names_resumes(variant, make_model, tmp_path, monkeypatch):
    """A checkpoint whose norms go by the local spec's names and that holds no `_extra_state` of
    norms and attention (specrl's MoE and MLA checkpoints before TE's names, Megatron-LM's with
    --transformer-impl local) resumes: the next step, which reads the model and Adam's moments,
    equals the saving run's."""
    from torch.distributed.checkpoint import FileSystemReader

    from trainer_bridge.actor import TrainActor
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.loss import LossConfig
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.model import provider as model_provider
    from trainer_bridge.options import TrainerArgs

    path = make_model(**VARIANTS[variant], vocab_size=300)
    tokens = [list(range(5, 17)), list(range(20, 32))]
    batch = TrainBatch(tokens, [6, 6], [1.0, 0.0], n_samples_per_prompt=2)

    def step(actor) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        metrics = {k: v for k, v in actor.train(batch).items() if not k.startswith("perf/")}
        state = actor.gpt.state_dict()
        return metrics, {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}

    def actor() -> TrainActor:
        return TrainActor(TrainerArgs(hf_checkpoint=path, lr=1e-2), LossConfig())

    with monkeypatch.context() as patch:
        patch.setattr(model_provider, "te_checkpoint_names", lambda spec: spec)
        patch.setattr(model_provider, "te_extra_states", lambda model: [])
        saving = actor()
        try:
            saving.train(batch)
            saving.save_checkpoint(str(tmp_path), 1)
            want_metrics, want_state = step(saving)
        finally:
            destroy_model_parallel()
    saved = FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    assert all(key in saved for key in LOCAL_KEYS[variant])
    resumed = actor()
    try:
        assert resumed.load_checkpoint(str(tmp_path)) == 1
        metrics, state = step(resumed)
    finally:
        destroy_model_parallel()
    assert metrics == want_metrics
    assert [k for k in want_state if not torch.equal(state[k], want_state[k])] == []
