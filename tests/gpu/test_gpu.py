"""CUDA checks (marked gpu; skipped without CUDA): torch_native on a GPU, real CUDA graphs,
FlashInfer."""

from __future__ import annotations

import pytest
import torch

from spec_engine import Engine
from tests.conftest import random_prompts
from tests.engine.test_speculative import models  # noqa: F401  (module fixture)

# Log-prob gap (nats) under which two bfloat16 computations may pick different greedy tokens.
BF16_MARGIN = 0.25


@pytest.mark.gpu
def test_cuda_float32_greedy_matches_transformers(family_path, hf):
    prompts = random_prompts(6, 3, 50, seed=30)
    with Engine(model_path=family_path, device="cuda", dtype="float32", random_seed=0) as engine:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 16},
            return_logprob=True,
        )
    for prompt, out in zip(prompts, outs):
        ref, ref_lp = hf.greedy(family_path, prompt, 16)
        assert out["output_ids"] == ref
        assert (
            max(
                abs(a - b)
                for (a, _, _), b in zip(out["meta_info"]["output_token_logprobs"], ref_lp)
            )
            < 1e-3
        )


@pytest.mark.gpu
def test_cuda_bfloat16_agrees_up_to_near_ties(llama_path, hf):
    """bfloat16 on CUDA against transformers in float32: each first token is the reference's
    argmax or within BF16_MARGIN nats of it (bfloat16 rounding can only flip near-ties)."""
    prompts = random_prompts(8, 3, 30, seed=31)
    with Engine(model_path=llama_path, device="cuda", random_seed=0) as engine:
        assert engine.args.dtype == "bfloat16"
        outs = engine.generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 8}
        )
    for prompt, out in zip(prompts, outs):
        logp = torch.log_softmax(hf.next_token_logits(llama_path, prompt), -1)
        assert logp.max() - logp[out["output_ids"][0]] <= BF16_MARGIN, prompt


# --- CUDA graphs and FlashInfer (issue [cuda-graphs]); run with a GPU: pytest -m gpu
# tests/gpu/test_gpu.py


def _generate(path, kwargs, params, prompts):
    with Engine(
        model_path=path,
        device="cuda",
        random_seed=0,
        max_running_requests=10,
        skip_tokenizer_init=True,
        **kwargs,
    ) as engine:
        return engine.generate(
            input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=4
        )


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["plain", "eagle-tree", "eagle3", "mtp", "standalone", "ngram"])
def test_real_cuda_graphs_equal_eager(models, algo):  # noqa: F811
    """Real CUDA graphs (torch_native, float32) as the batch shrinks 10 -> 1 through captured
    sizes 1 3 8 and above them: identical tokens to eager, the self-check on."""
    from tests.engine.test_cuda_graph import LENGTHS, _engine_kwargs

    path, kwargs = _engine_kwargs(models, algo)
    kwargs = dict(kwargs, dtype="float32", attention_backend="torch_native")
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in LENGTHS]
    prompts = random_prompts(10, 6, 14, seed=3)
    eager = _generate(path, dict(kwargs, disable_cuda_graph=True), params, prompts)
    for graphs in (
        dict(cuda_graph_bs=[1, 3, 8]),
        dict(cuda_graph_bs=[1, 2, 4]),
        dict(cuda_graph_bs=[1, 3, 8], disable_cuda_graph_padding=True),
    ):
        outs = _generate(path, dict(kwargs, cuda_graph_self_check=True, **graphs), params, prompts)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in eager], graphs
        diffs = [
            abs(a[0] - b[0])
            for o, r in zip(outs, eager)
            for a, b in zip(
                o["meta_info"]["output_token_logprobs"], r["meta_info"]["output_token_logprobs"]
            )
        ]
        assert max(diffs) < 1e-3, graphs


@pytest.fixture(scope="module")
def wide_models(make_model, tmp_path_factory):
    """head_dim 64 (FlashInfer has kernels for it): a Llama target and an EAGLE-2 draft."""
    from tiny.checkpoints import build_eagle_draft

    target = make_model(
        "llama", num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2
    )
    return target, build_eagle_draft(
        str(tmp_path_factory.mktemp("wide") / "eagle"), target, version=2
    )


def assert_equal_up_to_near_ties(outs, refs, margin: float = BF16_MARGIN) -> None:
    """Each sequence equals its reference up to the first token where they differ, and there the
    reference's own top log-probs show a near-tie (our token within `margin` nats of its choice);
    past that point the sequences are free to differ."""
    for out, ref in zip(outs, refs):
        for j, (ours, theirs) in enumerate(zip(out["output_ids"], ref["output_ids"])):
            if ours != theirs:
                top = {t: lp for lp, t, _ in ref["meta_info"]["output_top_logprobs"][j]}
                assert ours in top and top[theirs] - top[ours] <= margin, (j, ours, theirs, top)
                break


@pytest.mark.gpu
def test_flashinfer_agrees_with_torch_native(wide_models):
    """FlashInfer decode/prefill/verify against torch_native, bfloat16, eager: equal tokens up to
    a near-tie (bf16 kernels reduce in different orders, which can flip only those)."""
    pytest.importorskip("flashinfer", reason="the [gpu] extra (flashinfer-python) is not installed")
    target, eagle = wide_models
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    prompts = random_prompts(8, 5, 40, seed=7)
    spec = dict(
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=eagle,
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=5,
    )
    for kwargs in ({}, spec):
        native = _generate(
            target,
            dict(kwargs, attention_backend="torch_native", disable_cuda_graph=True),
            params,
            prompts,
        )
        fi = _generate(
            target,
            dict(kwargs, attention_backend="flashinfer", disable_cuda_graph=True),
            params,
            prompts,
        )
        assert_equal_up_to_near_ties(fi, native)


@pytest.mark.gpu
def test_flashinfer_cuda_graphs_equal_eager(wide_models):
    """FlashInfer under real CUDA graphs (re-planned before each replay, padded batches) against
    FlashInfer eager, plain and EAGLE tree, with the startup self-check on."""
    pytest.importorskip("flashinfer", reason="the [gpu] extra (flashinfer-python) is not installed")
    target, eagle = wide_models
    from tests.engine.test_cuda_graph import LENGTHS

    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in LENGTHS]
    prompts = random_prompts(10, 6, 14, seed=3)
    spec = dict(
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=eagle,
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=5,
    )
    for kwargs in ({}, spec):
        kwargs = dict(kwargs, attention_backend="flashinfer")
        eager = _generate(target, dict(kwargs, disable_cuda_graph=True), params, prompts)
        graphs = _generate(
            target,
            dict(kwargs, cuda_graph_bs=[1, 3, 8], cuda_graph_self_check=True),
            params,
            prompts,
        )
        assert_equal_up_to_near_ties(graphs, eager)


@pytest.mark.gpu
def test_cuda_bf16_train_step_and_colocated_push(make_model):
    """The trainer on CUDA in bfloat16 (megatron's mixed-precision optimizer: the model must be
    on the GPU), a GRPO step with online MTP training, then a colocated push (buckets shared by
    CUDA IPC in SGLang's serializer format) into an engine on the same GPU, checked by checksum."""
    pytest.importorskip("megatron.core", reason="megatron-core (scripts/gpu/pack.sh trainer)")
    from tiny.checkpoints import add_mimo_mtp
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.loss import LossConfig
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs
    from trainer_bridge.weight_sync import WeightPusher, WeightSyncConfig

    mimo = add_mimo_mtp(make_model("qwen2", num_layers=2, seed=61), seed=62)
    args = TrainerArgs(
        hf_checkpoint=mimo, bf16=True, lr=1e-4, micro_batch_size=4, enable_mtp_training=True
    )
    actor = TrainActor(args, LossConfig(), temperature=1.0)
    try:
        assert {p.device.type for p in actor.gpt.parameters()} == {"cuda"}
        spec = dict(
            speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1
        )
        with Engine(model_path=mimo, device="cuda", random_seed=0, **spec) as engine:
            prompts = random_prompts(2, 5, 9, seed=63)
            params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "n": 4}
            outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            tokens = [
                p + o["output_ids"] for p, o in zip([q for q in prompts for _ in range(4)], outs)
            ]
            batch = TrainBatch(
                tokens,
                [len(o["output_ids"]) for o in outs],
                [float(t[-1] % 2) for t in tokens],
                rollout_log_probs=[
                    [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs
                ],
                n_samples_per_prompt=4,
            )
            metrics = actor.train(batch)
            assert metrics["train/grad_norm"] > 0
            cfg = WeightSyncConfig(check_weight_update_equal=True)
            pusher = WeightPusher([engine], cfg, colocated=True)
            pusher.push(actor.hf_named_tensors(), version="1")
            pusher.close()
            assert engine.get_server_info()["weight_version"] == "1"
    finally:
        destroy_model_parallel()


@pytest.mark.gpu
def test_flashinfer_fused_kernels_match_their_stand_ins():
    """FlashInfer's fused decoder kernels against the CPU stand-ins the engine tests run
    (layers/fused.py), on CUDA in bfloat16: the stand-ins are what the kernels compute."""
    pytest.importorskip("flashinfer", reason="the [gpu] extra (flashinfer-python) is not installed")
    from spec_engine.layers import fused
    from spec_engine.layers.rotary import RotaryEmbedding

    fi, ref = fused.flashinfer_kernels(), fused.reference_kernels()
    torch.manual_seed(0)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    weight = torch.randn(256, device=dev, dtype=bf16)
    x, res = (
        torch.randn(7, 256, device=dev, dtype=bf16),
        torch.randn(7, 256, device=dev, dtype=bf16),
    )
    close = dict(rtol=2**-7, atol=2e-2)
    torch.testing.assert_close(fi.rmsnorm(x, weight, 1e-6), ref.rmsnorm(x, weight, 1e-6), **close)
    xa, ra, xb, rb = x.clone(), res.clone(), x.clone(), res.clone()
    fi.add_rmsnorm(xa, ra, weight, 1e-6)
    ref.add_rmsnorm(xb, rb, weight, 1e-6)
    torch.testing.assert_close(ra, rb, **close)
    torch.testing.assert_close(xa, xb, **close)
    gate_up = torch.randn(7, 2 * 96, device=dev, dtype=bf16)
    torch.testing.assert_close(fi.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **close)
    for rotary_dim in (64, 32):  # full and partial (GLM-4.5) rotary
        rotary = RotaryEmbedding(64, 128, 10000.0, None, rotary_dim)
        positions = torch.tensor([0, 3, 9, 127, 5, 6, 1], device=dev)
        qkv = torch.randn(7, (4 + 2 + 2) * 64, device=dev, dtype=bf16)
        outs = []
        for kernels in (fi, ref):
            q, k, _ = qkv.clone().split([256, 128, 128], dim=-1)
            kernels.rope(positions, q, k, 64, rotary._cache(dev), True)
            outs.append((q, k))
        torch.testing.assert_close(outs[0][0], outs[1][0], **close)
        torch.testing.assert_close(outs[0][1], outs[1][1], **close)
    from spec_engine.mem.kv_pool import KVPool

    pools = [KVPool(64, 1, 1, 2, 64, bf16, dev) for _ in range(2)]
    loc = torch.tensor([9, 4, 30, 17, 60], device=dev)
    k, v = (
        torch.randn(5, 2, 64, device=dev, dtype=bf16),
        torch.randn(5, 2, 64, device=dev, dtype=bf16),
    )
    for pool, kernels in zip(pools, (fi, ref)):
        pool.k_buffer[0].zero_(), pool.v_buffer[0].zero_()
        fused.install(torch.nn.Module(), pool, kernels)
        pool.set_kv(0, loc, k, v)
    assert torch.equal(pools[0].k_buffer[0], pools[1].k_buffer[0])
    assert torch.equal(pools[0].v_buffer[0], pools[1].v_buffer[0])
