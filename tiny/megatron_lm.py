"""Write tests/data/megatron_lm_<arch>: a tiny checkpoint saved by Megatron-LM's own code
(megatron/training/checkpointing.py `save_checkpoint`, --ckpt-format torch_dist), as slime's
tools/convert_hf_to_torch_dist.py and its --save write them, next to the Hugging Face checkpoint
it holds: `--arch qwen2` a dense Qwen2, `--arch deepseek_v3` a DeepSeek-V3 (MLA, a dense first
layer then MoE, one MTP layer: --mtp-num-layers 1), `--arch glm4_moe` a GLM-4.5 (GQA, the same
MoE and MTP layer). Megatron-LM's training package is not on
PyPI: pass a checkout of it at the tag of the installed megatron-core (core_v0.16.1), whose
megatron/training joins the installed megatron.core.

    git clone -b core_v0.16.1 https://github.com/NVIDIA/Megatron-LM /tmp/Megatron-LM
    python -m scripts.make_megatron_lm_checkpoint --megatron-lm /tmp/Megatron-LM \
        --arch deepseek_v3 --out tests/data/megatron_lm_deepseek_v3

OUT/hf/        the tiny model (config, safetensors, tokenizer), built by tiny.checkpoints
OUT/megatron/  Megatron-LM's --save directory: latest_checkpointed_iteration.txt ("1") and
               iter_0000001/ (common.pt with Megatron-LM's args, .metadata, __0_*.distcp)
OUT/build.json the build_checkpoint arguments (a test rebuilds a same-shape model from them)

The flow is slime's converter's: Megatron-LM's parse_args and validate_args over the flags a
slime run of this model passes, the model built by Megatron-LM's model_provider(gpt_builder)
(--transformer-impl local: no Transformer Engine here), the Hugging Face weights loaded into it
by specrl's converter, then `save_checkpoint(1, [model], None, None, 0)`, on CPU with gloo. The
local spec names some MLA and MoE norms otherwise than TE's spec, which slime's runs use: the
trainer reads either (trainer_bridge.model.checkpoint_names).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

from spec_engine.models.hf_config import ModelConfig
from trainer_bridge.megatron_compat import apply_cpu_shims, filter_known_warnings


def _stub_triton() -> None:
    """CPU shim: megatron/training/initialize.py imports megatron.core's
    transformer/custom_layers/batch_invariant_kernels, which does `import triton` and decorates
    kernels with @triton.jit at import (ModuleNotFoundError: No module named 'triton' on a CPU
    torch). The kernels only run in batch-invariant mode (off): an inert stand-in is enough."""
    import importlib.util
    import types

    if importlib.util.find_spec("triton") is not None:
        return

    def jit(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    class _Language(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return object

    triton = types.ModuleType("triton")
    triton.jit = jit
    triton.cdiv = lambda a, b: -(-a // b)
    triton.language = _Language("triton.language")
    sys.modules["triton"] = triton
    sys.modules["triton.language"] = triton.language
    try:
        import megatron.training  # noqa: F401
    finally:  # visible to that import only (transformers and torch probe for triton too)
        del sys.modules["triton"], sys.modules["triton.language"]


COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# build_checkpoint's arguments per model: a dense Qwen2, a DeepSeek-V3 (MLA, a dense first layer
# then MoE with grouped routing and a shared expert, one next-n MTP layer) and a GLM-4.5 (GQA
# with q/k norms and partial rotary, the same MoE and MTP layer).
BUILDS = {
    "qwen2": dict(COMMON, arch="qwen2", num_kv_heads=2, seed=61),
    "deepseek_v3": dict(
        COMMON, arch="deepseek_v3", seed=62, extra_config={"num_nextn_predict_layers": 1}
    ),
    "glm4_moe": dict(
        COMMON,
        arch="glm4_moe",
        num_kv_heads=2,
        seed=63,
        extra_config={"num_nextn_predict_layers": 1},
    ),
}


def build_hf(hf_dir: str, build: dict) -> None:
    from tiny.checkpoints import build_checkpoint, build_tokenizer

    tok = build_tokenizer(hf_dir, vocab_size=build["vocab_size"])
    bos, eos = tok.convert_tokens_to_ids(["<s>", "</s>"])
    assert (bos, eos) == (build["bos_token_id"], build["eos_token_id"]), (bos, eos)
    assert len(tok) <= build["vocab_size"], len(tok)
    build_checkpoint(hf_dir, **build)


def model_argv(hf_config: dict) -> list[str]:
    """The model flags of a slime run of this checkpoint (slime's scripts/models/qwen2.5-*.sh,
    deepseek-v3.sh and glm4.5-*.sh, sized down; allgather dispatch, no grouped GEMM: no CUDA or TE
    here), from the config as specrl reads it (spec_engine.models.hf_config)."""
    m = ModelConfig.load(hf_config)
    argv = [
        "--num-layers",
        str(m.num_hidden_layers),
        "--hidden-size",
        str(m.hidden_size),
        "--ffn-hidden-size",
        str(m.intermediate_size),
        "--num-attention-heads",
        str(m.num_attention_heads),
        "--max-position-embeddings",
        str(m.max_position_embeddings),
        "--normalization",
        "RMSNorm",
        "--norm-epsilon",
        str(m.rms_norm_eps),
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        str(int(m.rope_theta)),
        "--vocab-size",
        str(m.vocab_size),
        *(moe_argv(m) if m.moe else []),
    ]
    return argv + (_gqa_argv(m) if m.mla is None else _mla_argv(m))


def _gqa_argv(m: ModelConfig) -> list[str]:
    """Grouped-query attention's flags: Qwen2, GLM-4.5 (slime's glm4.5-355B-A32B.sh; Air: no q/k
    norm)."""
    return [
        "--group-query-attention",
        "--num-query-groups",
        str(m.num_key_value_heads),
        "--kv-channels",
        str(m.head_dim),
        *(["--add-qkv-bias"] if m.qkv_bias else []),
        *(
            ["--rotary-percent", str(m.partial_rotary_factor)]
            if m.partial_rotary_factor != 1
            else []
        ),
        *(["--qk-layernorm"] if m.qk_norm else []),
    ]


def _mla_argv(m: ModelConfig) -> list[str]:
    """Multi-latent attention's flags: DeepSeek-V3 (slime's deepseek-v3.sh)."""
    assert m.rope_scaling is None, "YaRN: add slime's --rotary-scaling-factor / --mscale flags"
    return [
        "--kv-channels",
        str(m.mla.v_head_dim),
        "--multi-latent-attention",
        *(["--q-lora-rank", str(m.mla.q_lora_rank)] if m.mla.q_lora_rank else []),
        "--kv-lora-rank",
        str(m.mla.kv_lora_rank),
        "--qk-head-dim",
        str(m.mla.qk_nope_head_dim),
        "--qk-pos-emb-head-dim",
        str(m.mla.qk_rope_head_dim),
        "--v-head-dim",
        str(m.mla.v_head_dim),
        "--qk-layernorm",
        "--rope-type",
        "rope",
    ]


def moe_argv(m: ModelConfig) -> list[str]:
    """The MoE and MTP flags of slime's DeepSeek-V3 and GLM-4.5 scripts for ModelConfig `m`."""
    moe, dense = m.moe, m.moe.first_k_dense_replace
    return [
        "--num-experts",
        str(moe.num_experts),
        "--moe-layer-freq",
        f"([0]*{dense}+[1]*{m.num_hidden_layers - dense})",
        "--moe-ffn-hidden-size",
        str(moe.intermediate_size),
        "--moe-router-topk",
        str(moe.top_k),
        "--moe-shared-expert-intermediate-size",
        str(moe.num_shared_experts * moe.intermediate_size),
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-load-balancing-type",
        "seq_aux_loss",
        "--moe-token-dispatcher-type",
        "allgather",
        "--moe-aux-loss-coeff",
        "0",
        "--moe-router-bias-update-rate",
        "0",
        "--moe-router-num-groups",
        str(moe.n_group),
        "--moe-router-group-topk",
        str(moe.topk_group),
        "--moe-router-topk-scaling-factor",
        str(moe.routed_scaling_factor),
        "--moe-router-dtype",
        "fp32",
        "--mtp-num-layers",
        str(m.num_mtp_layers),
    ]


def megatron_lm_args(save_dir: str, hf_config: dict, extra_argv: tuple[str, ...] = ()):
    """Megatron-LM's own parse_args + validate_args over the argv a slime run of this model
    would pass (model_argv; float32, torch_dist), then `extra_argv`."""
    from megatron.training.arguments import parse_args, validate_args

    argv = ["make.py", *model_argv(hf_config)] + [
        "--seq-length",
        "64",
        "--make-vocab-size-divisible-by",
        "128",
        "--attention-dropout",
        "0.0",
        "--hidden-dropout",
        "0.0",
        "--transformer-impl",
        "local",
        "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion",
        "--no-bias-swiglu-fusion",
        "--no-rope-fusion",
        "--no-persist-layer-norm",  # the local spec's torch norms refuse it
        "--use-cpu-initialization",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--train-iters",
        "1",
        "--lr",
        "1e-6",
        "--seed",
        "1234",
        "--save",
        save_dir,
        "--save-interval",
        "1",
        "--ckpt-format",
        "torch_dist",
        "--tokenizer-type",
        "NullTokenizer",
        *extra_argv,
    ]
    saved_argv = sys.argv
    sys.argv = argv
    try:
        args = parse_args()
    finally:
        sys.argv = saved_argv
    validate_args(args)
    # What the rest of Megatron-LM's start-up would set (build_tokenizer pads the vocabulary;
    # pretrain()/get_model set the model type), here from the model that is saved.
    from megatron.core.enums import ModelType

    args.padded_vocab_size = -(-hf_config["vocab_size"] // 128) * 128
    args.model_type = ModelType.encoder_or_decoder
    return args


def megatron_lm_model(args):
    """Megatron-LM's own model: model_provider(gpt_builder) as get_model's build_model calls it
    (pretrain_gpt.py / slime's get_model(..., wrap_with_ddp=False)), without get_model's
    `.cuda()` (CPU; slime moves it back with `.cpu()` under --use-cpu-initialization anyway)."""
    from functools import partial

    from gpt_builders import gpt_builder
    from megatron.core import tensor_parallel
    from megatron.core.enums import ModelType
    from model_provider import model_provider

    model = partial(model_provider, gpt_builder)(pre_process=True, post_process=True)
    model.model_type = ModelType.encoder_or_decoder
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    return model


def save_megatron_lm(out: str, build: dict) -> None:
    hf_dir, save_dir = os.path.join(out, "hf"), os.path.join(out, "megatron")
    for d in (hf_dir, save_dir):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(hf_dir)
    build_hf(hf_dir, build)
    with open(os.path.join(out, "build.json"), "w") as f:
        json.dump(build, f, indent=1)
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)

    apply_cpu_shims()
    _stub_triton()  # then import megatron.training
    from megatron.training import checkpointing
    from megatron.training.global_vars import set_args

    from trainer_bridge.convert import load_hf_weights
    from trainer_bridge.megatron_compat import destroy_model_parallel, init_model_parallel

    args = megatron_lm_args(save_dir, hf_config)
    set_args(args)
    init_model_parallel(1, 1, seed=args.seed)  # gloo, one rank: parallel state, RNG trackers
    model = megatron_lm_model(args)
    # the HF weights, through specrl's converter (trainer_bridge.convert)
    load_hf_weights(model, hf_dir)
    assert args.padded_vocab_size == model.embedding.word_embeddings.weight.shape[0]
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters())} parameters")

    # CPU shim: Megatron-LM's get_rng_state records torch.cuda.get_rng_state(), which raises
    # "Torch not compiled with CUDA enabled" on a CPU build; the CPU generator's state stands in
    # (a ByteTensor, as the CUDA one is).
    cuda_get_rng_state = torch.cuda.get_rng_state
    if not torch.cuda.is_available():
        torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    try:
        # slime's tools/convert_hf_to_torch_dist.py: save_checkpoint(1, model, None, None, 0)
        checkpointing.save_checkpoint(1, [model], None, None, 0)
    finally:
        torch.cuda.get_rng_state = cuda_get_rng_state
    destroy_model_parallel()


def main(argv: list[str] | None = None) -> None:
    """`python -m scripts.make_megatron_lm_checkpoint`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout")
    parser.add_argument("--arch", choices=sorted(BUILDS), default="qwen2")
    parser.add_argument("--out", required=True)
    cli = parser.parse_args(argv)
    # The installed `megatron` (the megatron-core wheel) is a namespace package: the checkout's
    # megatron/training (and the modules it imports) join it from a later sys.path entry.
    sys.path.append(os.path.abspath(cli.megatron_lm))
    filter_known_warnings()
    save_megatron_lm(os.path.abspath(cli.out), BUILDS[cli.arch])
