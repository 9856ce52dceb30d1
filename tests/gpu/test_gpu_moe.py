"""CUDA checks of the MoE/MLA models and their trainer paths (marked gpu; skipped without CUDA):
DeepSeek-V3 (MLA's latent KV cache, grouped sigmoid routing) against transformers, its next-n
layers drafting under real CUDA graphs, routing replay between a CUDA engine and a CUDA trainer,
and a --bf16 checkpoint's float32 main weights and Adam moments through save and load."""

from __future__ import annotations

import pytest
import torch

from spec_engine import Engine
from tests.conftest import FAMILIES, random_prompts
from tests.engine.test_deepseek_v3 import MTP, VARIANTS
from tests.gpu.test_gpu import _generate

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cuda_deepseek_v3_float32_matches_transformers(make_model, hf, variant, record_property):
    path = make_model("deepseek_v3", **VARIANTS[variant])
    prompts = random_prompts(6, 3, 40, seed=70)
    with Engine(model_path=path, device="cuda", dtype="float32", random_seed=0) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    gaps = []
    for prompt, out in zip(prompts, outs):
        ref, ref_lp = hf.greedy(path, prompt, GREEDY["max_new_tokens"])
        assert out["output_ids"] == ref
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        gaps.append(max(abs(a - b) for a, b in zip(got, ref_lp)))
    record_property("max_logprob_gap", max(gaps))
    assert max(gaps) < 1e-3


def _nextn(path: str, prompts: list, **kwargs) -> list[dict]:
    params = [{**GREEDY, "max_new_tokens": 4 + 5 * i} for i in range(len(prompts))]
    kwargs = dict(kwargs, dtype="float32", attention_backend="torch_native")
    return _generate(path, kwargs, params, prompts)


@pytest.mark.gpu
def test_cuda_deepseek_nextn_layers_under_real_graphs_are_lossless(make_model, record_property):
    """Two next-n layers, step k on layer k (--enable-multi-layer-eagle), as the batch shrinks
    8 -> 1 through captured sizes 1 3 8 with the self-check: tokens equal plain eager decoding."""
    path = make_model("deepseek_v3", **MTP)
    prompts = random_prompts(8, 3, 20, seed=71)
    plain = _nextn(path, prompts, disable_cuda_graph=True)
    spec = dict(
        speculative_algorithm="NEXTN",
        enable_multi_layer_eagle=True,
        speculative_num_steps=2,
        speculative_eagle_topk=1,
    )
    eager = _nextn(path, prompts, disable_cuda_graph=True, **spec)
    graphs = _nextn(path, prompts, cuda_graph_bs=[1, 3, 8], cuda_graph_self_check=True, **spec)
    ids = [o["output_ids"] for o in plain]
    assert [o["output_ids"] for o in eager] == ids
    assert [o["output_ids"] for o in graphs] == ids
    gap = max(
        abs(a[0] - b[0])
        for o, r in zip(graphs, plain)
        for a, b in zip(
            o["meta_info"]["output_token_logprobs"], r["meta_info"]["output_token_logprobs"]
        )
    )
    record_property("max_logprob_gap_vs_plain", gap)
    assert gap < 1e-3


@pytest.mark.gpu
def test_cuda_routing_replay_log_probs_are_the_engines(make_model, record_property):
    """A GLM-4.5-shaped MoE: the CUDA engine's routed experts replayed by the CUDA trainer
    (float32): the trainer's log-probs of the rollout equal the engine's."""
    pytest.importorskip("megatron.core", reason="megatron-core (scripts/gpu/pack.sh trainer)")
    from tests.trainer.test_routing_replay_trainer import rollout_batch
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    glm = make_model(**FAMILIES["glm4_moe"])
    prompts = random_prompts(2, 5, 11, seed=72)
    batch, engine_logps = rollout_batch(glm, prompts, device="cuda", dtype="float32")
    actor = TrainActor(
        TrainerArgs(hf_checkpoint=glm, lr=1e-4, micro_batch_size=3, use_rollout_routing_replay=True)
    )
    try:
        assert {p.device.type for p in actor.gpt.parameters()} == {"cuda"}
        got = actor.compute_log_probs(batch)
        metrics = actor.train(batch)
    finally:
        destroy_model_parallel()
    flat = lambda xs: torch.tensor([v for x in xs for v in x], dtype=torch.float32, device="cpu")  # noqa: E731
    gap = (flat(got) - flat(engine_logps)).abs().max().item()
    record_property("max_logprob_gap", gap)
    assert gap < 1e-3
    assert metrics["train/grad_norm"] > 0


@pytest.mark.gpu
def test_cuda_bf16_checkpoint_restores_main_weights_and_adam(make_model, tmp_path, record_property):
    """--bf16 on CUDA: megatron's float32 main copy of each weight and Adam's moments are saved
    and loaded bit for bit (not rebuilt from the bfloat16 weights), and the resumed policy's
    next step equals the saving one's."""
    pytest.importorskip("megatron.core", reason="megatron-core (scripts/gpu/pack.sh trainer)")
    from tests.e2e.test_checkpoint import _tp_batches
    from tiny.checkpoints import add_mimo_mtp
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.checkpoint.optimizer import trained
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    mimo = add_mimo_mtp(make_model("qwen2", num_layers=2, seed=73), seed=74)
    args = TrainerArgs(hf_checkpoint=mimo, bf16=True, lr=1e-3, enable_mtp_training=True)
    first, second = _tp_batches()[:2]

    def state(actor) -> dict[str, torch.Tensor]:
        out = {}
        for name, param, main, optimizer in trained(actor):
            # bfloat16 weights train through a float32 main copy; float32 ones (norms) as they are
            assert main.dtype == torch.float32 and main.is_cuda, name
            assert (main is not param) == (param.dtype == torch.bfloat16), name
            out[name] = main.detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{key}"] = optimizer.state[main][key].clone()
        return out

    def step(actor) -> dict[str, float]:
        return {k: v for k, v in actor.train(second).items() if "perf/" not in k}

    actor = TrainActor(args)
    try:
        assert any(p.dtype == torch.bfloat16 for p in actor.gpt.parameters())
        actor.train(first)
        actor.save_checkpoint(str(tmp_path), 0)
        saved = state(actor)
        want = step(actor)
    finally:
        destroy_model_parallel()
    actor = TrainActor(args)
    try:
        assert actor.load_checkpoint(str(tmp_path)) == 0
        loaded = state(actor)
        got = step(actor)
    finally:
        destroy_model_parallel()
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    gaps = {k: abs(got[k] - want[k]) / max(abs(want[k]), 1e-12) for k in want}
    record_property("max_rel_metric_gap_after_resume", max(gaps.values()))
    assert max(gaps.values()) < 1e-3, gaps
