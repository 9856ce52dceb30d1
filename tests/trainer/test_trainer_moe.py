"""The trainer on GLM-4.5 MoE (Glm4MoeForCausalLM) and DeepSeek-V3 (multi-latent attention + the
same MoE): megatron's MoE GPTModel gives transformers' logits (its expert-bias router picks the
same experts as the checkpoint's e_score_correction_bias), Hugging Face -> megatron -> Hugging
Face keeps every tensor bit for bit (routed and shared experts, router, bias, dense first layer,
the next-n layers, whose megatron MTP layer equals one built from transformers' modules), the
TrainActor builds from either checkpoint and steps (training the next-n layer online, the balance
loss logged), megatron's balance loss reaches the logs, and what megatron would compute
differently is refused. GLM-4.5 under TP=2 (experts split over ranks) runs in
tests/trainer/test_convert.py's two-rank test."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import FAMILIES
from torch.nn import functional as F

from trainer_bridge.convert import (
    hf_to_mcore,
    load_hf_weights,
    load_mcore_rank,
    mcore_to_hf,
    mcore_to_hf_tensors,
    read_hf_weights,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:::megatron"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU megatron tests"),
]
VOCAB = 300  # megatron pads it to 384
T = 12
ATOL = 1e-4
# "glm4_moe": q/k norms, grouped routing, a next-n layer (conftest.FAMILIES); "flat": no q/k
# norm, one expert group (plain top-k), a tied head, no next-n layer; "deepseek_v3": MLA with a
# query bottleneck and interleaved rope (tiny.checkpoints.DEEPSEEK_V3_TINY) under YaRN with
# both mscales (as DeepSeek-V3 itself), GLM's routing, a next-n layer with its embedding and head
# copies.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
VARIANTS = {
    "deepseek_v3": dict(
        arch="deepseek_v3", extra_config={"rope_parameters": YARN, "num_nextn_predict_layers": 1}
    ),
    "glm4_moe": FAMILIES["glm4_moe"],
    "flat": dict(
        arch="glm4_moe",
        tie_word_embeddings=True,
        extra_config={"use_qk_norm": False, "n_group": 1, "num_nextn_predict_layers": 0},
    ),
}


@pytest.fixture(scope="session")
def checkpoints(make_model) -> dict[str, str]:
    return {name: make_model(**kw, vocab_size=VOCAB) for name, kw in VARIANTS.items()}


def _ids() -> torch.Tensor:
    return torch.randint(5, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def hf_logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(_ids()).logits


def megatron_logits(model) -> torch.Tensor:
    """Logits over the real vocabulary; the MTP block (it needs labels) is skipped, as the
    TrainActor skips it for the policy's logits. Under no_grad unless the model trains."""
    saved = (model.mtp_process, model.config.mtp_num_layers)
    model.mtp_process, model.config.mtp_num_layers = False, None
    try:
        positions = torch.arange(T).expand(2, T)
        with torch.set_grad_enabled(model.training):
            return model(_ids(), positions, None, runtime_gather_output=True)[..., :VOCAB]
    finally:
        model.mtp_process, model.config.mtp_num_layers = saved


@pytest.fixture
def tp1():
    from trainer_bridge.megatron_compat import model_parallel

    with model_parallel(1, 1):
        yield


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_and_export_is_exact(variant, checkpoints, tp1):
    from trainer_bridge.model.provider import build_gpt_model

    path = checkpoints[variant]
    model = build_gpt_model(path).eval()
    load_hf_weights(model, path)
    layers = model.decoder.layers
    assert type(layers[0].mlp).__name__ == "MLP" and type(layers[1].mlp).__name__ == "MoELayer"
    logits = megatron_logits(model)
    torch.testing.assert_close(logits, hf_logits(path), rtol=0, atol=ATOL)
    exported = dict(mcore_to_hf_tensors(model, path))
    original = read_hf_weights(path)
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    # The correction bias decides the experts: without it megatron's routing (and logits) differ.
    bias = layers[1].mlp.router.expert_bias
    assert torch.equal(bias, original["model.layers.1.mlp.gate.e_score_correction_bias"])
    saved = bias.clone()
    bias.zero_()
    try:
        assert (megatron_logits(model) - logits).abs().max() > 100 * ATOL
    finally:
        bias.copy_(saved)


@torch.no_grad()
def mtp_reference(path: str) -> torch.Tensor:
    """Next-n layer 0's output `[b, s, h]` from transformers' modules: its decoder layer is
    layer N of the same class built with N + 1 layers, reading eh_proj([enorm(embedding of the
    next token), hnorm(the trunk's final hidden state)]), then shared_head.norm; inputs aligned as
    megatron's MTP training aligns them (position i reads token i + 1, the last reads token 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    n, h, eps = config.num_hidden_layers, config.hidden_size, config.rms_norm_eps
    config.num_hidden_layers = n + 1
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    model = model.eval().model
    prefix = f"model.layers.{n}."
    w = {k[len(prefix) :]: v for k, v in read_hf_weights(path).items() if k.startswith(prefix)}
    ids, positions = _ids(), torch.arange(T).expand(2, T)
    hidden = model.norm(model(ids, output_hidden_states=True).hidden_states[n])
    next_ids = torch.roll(ids, -1, dims=1)
    next_ids[:, -1] = 0
    embedded = F.rms_norm(model.embed_tokens(next_ids), (h,), w["enorm.weight"], eps)
    x = torch.cat((embedded, F.rms_norm(hidden, (h,), w["hnorm.weight"], eps)), dim=-1)
    x = x @ w["eh_proj.weight"].T
    out = model.layers[n](
        x, position_embeddings=model.rotary_emb(x, positions), position_ids=positions
    )
    out = out[0] if isinstance(out, tuple) else out
    return F.rms_norm(out, (h,), w["shared_head.norm.weight"], eps)


@pytest.mark.parametrize("variant", ["glm4_moe", "deepseek_v3"])
def test_mtp_layer_matches_transformers_modules(variant, checkpoints, tp1):
    from trainer_bridge.model.provider import build_gpt_model

    path = checkpoints[variant]
    model = build_gpt_model(path).eval()
    load_hf_weights(model, path)
    captured = []
    hook = model.mtp.layers[0].register_forward_hook(lambda m, args, out: captured.append(out[0]))
    with torch.no_grad():
        model(_ids(), torch.arange(T).expand(2, T), None, labels=_ids())
    hook.remove()
    got = captured[0].transpose(0, 1)
    torch.testing.assert_close(got, mtp_reference(path), rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    ("variant", "tp", "ep"),
    [("glm4_moe", 1, 1), ("glm4_moe", 2, 1), ("deepseek_v3", 2, 2), ("glm4_moe", 1, 4)],
)
def test_roundtrip_is_bit_exact(variant, tp, ep, checkpoints, tmp_path):
    """HF -> megatron files of every TP and EP rank -> HF gives the tensors back bit for bit."""
    src = checkpoints[variant]
    hf_to_mcore(src, str(tmp_path / "mcore"), tp=tp, ep=ep)
    # the last rank holds the last 8 / ep experts, numbered from 0 as its model names them
    shard = load_mcore_rank(str(tmp_path / "mcore"), tp - 1, ep - 1)
    experts = {k for k in shard if ".layers.1.mlp.experts.local_experts." in k}
    assert len(experts) == 2 * 8 // ep  # fc1 and fc2 of each
    expert = f"decoder.layers.1.mlp.experts.local_experts.{8 // ep - 1}.linear_fc1.weight"
    assert shard[expert].shape == (2 * 32 // tp, 64)  # gate and up rows, each split over TP
    if variant == "glm4_moe":
        assert shard["mtp.layers.0.transformer_layer.mlp.router.expert_bias"].shape == (8,)
    mcore_to_hf(str(tmp_path / "mcore"), src, str(tmp_path / "hf"))
    original, restored = read_hf_weights(src), read_hf_weights(str(tmp_path / "hf"))
    assert restored.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(restored[key], tensor), key


def test_balance_loss_reaches_the_logs(checkpoints, tp1):
    from trainer_bridge.model.moe import moe_aux_losses
    from trainer_bridge.model.provider import build_gpt_model

    path = checkpoints["flat"]
    assert moe_aux_losses() == {} or not any(moe_aux_losses().values())
    model = build_gpt_model(path, moe_aux_loss_coeff=1e-2).train()
    load_hf_weights(model, path)
    megatron_logits(model).sum().backward()
    losses = moe_aux_losses()
    assert losses["moe_seq_load_balancing_loss"] > 0
    assert moe_aux_losses()["moe_seq_load_balancing_loss"] == 0  # read once, then cleared


def _routers(model) -> list:
    return [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]


# GLM-4.5 moves its expert bias (DeepSeek-V3's auxiliary-loss-free balancing), DeepSeek-V3 keeps
# the checkpoint's (the default rate 0).
@pytest.mark.parametrize("variant,bias_rate", [("glm4_moe", 0.1), ("deepseek_v3", 0.0)])
def test_train_actor_builds_and_steps(variant, bias_rate, checkpoints, monkeypatch):
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.model import moe
    from trainer_bridge.options import TrainerArgs

    path = checkpoints[variant]
    ids = _ids().tolist()
    batch = TrainBatch(ids, [4, 4], [1.0, 0.0], n_samples_per_prompt=2)
    # The next-n layer trains online (its loss through megatron's MTP block: MLA builds no rotary
    # module) and the balance loss covers it too (megatron's tracker sized for it: see moe.py).
    args = TrainerArgs(
        hf_checkpoint=path,
        lr=1e-3,
        micro_batch_size=1,
        enable_mtp_training=True,
        moe_aux_loss_coeff=1e-4,
        moe_router_bias_update_rate=bias_rate,
    )
    actor = TrainActor(args)
    try:
        got = actor.compute_log_probs(batch)
        logp = torch.log_softmax(hf_logits(path), dim=-1)
        expected = [
            [logp[b, t - 1, ids[b][t]].item() for t in range(T - 4, T)] for b in range(len(ids))
        ]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=ATOL)
        trunk = _routers(actor.gpt.decoder)
        # Routers count only real tokens: 12 + 9 of a padded micro batch, top_k experts each.
        with torch.enable_grad():
            actor._forward(actor._micro_batch(_ids(), [T, T - 3]))
        top_k = actor.gpt.config.moe_router_topk
        assert [float(r.local_tokens_per_expert.sum()) for r in trunk] == [
            (2 * T - 3) * top_k
        ] * len(trunk)
        moe.update_expert_bias(actor.gpt, 0.0)  # restarts the counts, moves nothing

        steps = []  # (counts, bias) of every router before each update
        original = moe.update_expert_bias

        def recorded(model, rate):
            routers = _routers(model)
            steps.append(
                [(r.local_tokens_per_expert.clone(), r.expert_bias.clone()) for r in routers]
            )
            original(model, rate)

        monkeypatch.setattr(moe, "update_expert_bias", recorded)
        metrics = actor.train(batch)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
        assert metrics["train/mtp_loss"] > 0
        # over its coefficient, per MoE layer (trunk and next-n) and micro batch: about 1
        assert 0.5 < metrics["train/moe_seq_load_balancing_loss"] < 3.0
        assert actor.compute_log_probs(batch) != got  # the step moved the policy
        # DeepSeek-V3's rule, step by step: overloaded experts' bias down by the rate, underloaded
        # ones' up; the engines get the moved bias with the weights.
        assert steps and all(len(s) == len(trunk) + 1 for s in steps)  # + the next-n layer's
        for before, after in zip(
            steps, steps[1:] + [[(None, r.expert_bias) for r in _routers(actor.gpt)]]
        ):
            for (counts, bias), (_, moved) in zip(before, after):
                assert counts.sum() > 0
                step = bias_rate * torch.sign(counts.mean() - counts)
                torch.testing.assert_close(moved, bias + step, rtol=0, atol=1e-7)
        moved = any(not torch.equal(r.expert_bias, b) for r, (_, b) in zip(trunk, steps[0]))
        assert moved == (bias_rate > 0)
        pushed = [v for k, v in actor.hf_named_tensors() if k.endswith("e_score_correction_bias")]
        routers = _routers(actor.gpt)
        assert len(pushed) == len(routers)
        for tensor, router in zip(pushed, routers):
            assert torch.equal(tensor.float(), router.expert_bias)
    finally:
        destroy_model_parallel()


def test_what_megatron_computes_differently_is_refused(checkpoints):
    from trainer_bridge.model.provider import check_tensor_parallel, read_model_config

    with open(os.path.join(checkpoints["flat"], "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises(ValueError, match="norm_topk_prob=False"):
        read_model_config({**cfg, "norm_topk_prob": False})
    with pytest.raises(ValueError, match="num_experts_per_tok=4 // topk_group=1"):
        read_model_config({**cfg, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 4})
    with open(os.path.join(checkpoints["deepseek_v3"], "config.json")) as f:
        dsv3 = json.load(f)
    with pytest.raises(ValueError, match="rope_interleave=false"):
        read_model_config({**dsv3, "rope_interleave": False})
    with pytest.raises(ValueError, match="rope scaling .*'linear'"):
        read_model_config({**dsv3, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="tensor parallel size 4 does not divide q_lora_rank=6"):
        check_tensor_parallel(read_model_config({**dsv3, "q_lora_rank": 6}), 4)
