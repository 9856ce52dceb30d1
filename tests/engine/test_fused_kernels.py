"""The fused decoder kernels (layers/fused.py): FlashInfer's on CUDA, checked on CPU through
stand-ins of FlashInfer's documented semantics, which work in place where FlashInfer does.

Two kinds of check: each stand-in against the torch reference it replaces (so the stand-ins are
what the kernels are documented to compute), and whole engines running the stand-ins against the
same engines without them, in float32 where both round the same way: equal tokens, log-probs
and accept lengths. The second catches a call site that passes the wrong layout, or lets a
kernel overwrite a tensor its caller still reads (a layer's input, a captured EAGLE-3 feature, a
graph's static buffer)."""

from __future__ import annotations

import pytest
import torch

from spec_engine import Engine
from spec_engine.layers import fused
from spec_engine.layers.norm import RMSNorm
from spec_engine.layers.rotary import RotaryEmbedding
from spec_engine.mem.kv_pool import KVPool
from tests.conftest import FAMILIES, random_prompts
from tiny.checkpoints import build_eagle_draft

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
# Emulated graphs with padding (3 prompts replay the batch-4 graph) and their self-check.
GRAPHS = dict(cuda_graph_bs=[1, 4], cuda_graph_self_check=True, max_running_requests=4)


def test_add_rmsnorm_stand_in_overwrites_both_inputs_with_the_reference_values():
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x, residual = torch.randn(6, 64), torch.randn(6, 64)
    ref_out, ref_res = norm(x, residual)
    x2, r2 = x.clone(), residual.clone()
    fused.reference_kernels().add_rmsnorm(x2, r2, norm.weight, norm.eps)
    torch.testing.assert_close(r2, ref_res, rtol=0, atol=0)
    torch.testing.assert_close(x2, ref_out, rtol=1e-6, atol=1e-6)
    # Through the module: the same values, returned in the tensors it was given.
    norm.add_kernel = fused.reference_kernels().add_rmsnorm
    x3, r3 = x.clone(), residual.clone()
    out, res = norm(x3, r3)
    assert out is x3 and res is r3
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    # owned(): a copy only where the kernel writes in place.
    assert norm.owned(residual) is not residual and torch.equal(norm.owned(residual), residual)
    norm.add_kernel = None
    assert norm.owned(residual) is residual


@pytest.mark.parametrize(
    "scaling,rotary_dim",
    [
        (None, None),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, None),
        (None, 16),  # partial rotary (GLM-4.5): the rest of each head passes through
    ],
)
def test_rope_stand_in_rotates_q_and_k_in_place_as_the_reference(scaling, rotary_dim):
    torch.manual_seed(1)
    rotary = RotaryEmbedding(32, 64, 10000.0, scaling, rotary_dim)
    positions = torch.tensor([0, 5, 17, 63, 2])
    qkv = torch.randn(5, (4 + 2 + 2) * 32)
    q, k, _ = qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1)
    q, k = q.reshape(5, 4, 32), k.reshape(5, 2, 32)  # views into qkv, as LlamaAttention has
    ref_q, ref_k = rotary(positions, q.clone(), k.clone())
    rotary.kernel = fused.reference_kernels().rope
    out_q, out_k = rotary(positions, q, k)
    assert out_q.data_ptr() == qkv.data_ptr()  # rotated where they lie
    torch.testing.assert_close(out_q, ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_k, ref_k, rtol=1e-6, atol=1e-6)
    # MLA's rope part of each head is not a row-major [T, heads * dim] view: the reference.
    wide = torch.randn(5, 4, 48)
    part = wide[..., 16:]
    assert rotary(positions, part, k.clone())[0].data_ptr() != part.data_ptr()


def test_silu_and_mul_stand_in_is_swiglu_over_the_fused_projection():
    gate_up = torch.randn(3, 2 * 24)
    gate, up = gate_up.split(24, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(fused.reference_kernels().silu_and_mul(gate_up), expected)


def test_kv_append_writes_each_token_to_its_slot_like_index_copy():
    pool = KVPool(32, 4, 1, 2, 8, torch.float32, torch.device("cpu"))
    loc = torch.tensor([9, 4, 30, 17])
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    pool.k_buffer[0].zero_(), pool.v_buffer[0].zero_()
    pool.set_kv(0, loc, k, v)
    want_k, want_v = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    pool.k_buffer[0].zero_(), pool.v_buffer[0].zero_()
    counts = fused.install(torch.nn.Module(), pool, fused.reference_kernels())
    assert counts["append_kv"] == 1
    pool.set_kv(0, loc, k, v)
    assert torch.equal(pool.k_buffer[0], want_k) and torch.equal(pool.v_buffer[0], want_v)
    # The same tensor rewritten in place (a graph's static buffer between runs).
    loc.copy_(torch.tensor([1, 2, 3, 5]))
    pool.set_kv(0, loc, v, k)
    assert torch.equal(pool.k_buffer[0][loc], v) and torch.equal(pool.v_buffer[0][loc], k)


@pytest.fixture
def stand_ins(monkeypatch):
    """Every engine built while this is active runs the CPU stand-ins, as a CUDA engine runs
    FlashInfer's kernels."""
    monkeypatch.setattr(fused, "kernels_for", lambda *a: fused.reference_kernels())


def _run(path: str, prompts, **kwargs):
    kwargs = {**GRAPHS, **kwargs}
    if kwargs.get("disable_cuda_graph"):
        del kwargs["cuda_graph_bs"], kwargs["cuda_graph_self_check"]
    with Engine(model_path=path, random_seed=0, dtype="float32", **kwargs) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        runners = [engine.scheduler.worker.runner]
        draft = getattr(engine.scheduler.worker, "draft", None)
        if draft is not None:
            runners.append(draft)
        kernels = [runner.fused_kernels for runner in runners]
    return outs, kernels


def _assert_same(fused_outs, plain_outs):
    for a, b in zip(fused_outs, plain_outs, strict=True):
        assert a["output_ids"] == b["output_ids"]
        la = [lp for lp, *_ in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, *_ in b["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=0, atol=1e-5)
        assert a["meta_info"].get("spec_verify_ct") == b["meta_info"].get("spec_verify_ct")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engines_with_the_stand_ins_decode_as_without(make_model, monkeypatch, family):
    path = make_model(**FAMILIES[family])
    prompts = random_prompts(3, 4, 20, seed=11)
    plain, kernels = _run(path, prompts)
    assert kernels == [{}]  # CPU: no fused kernels unless asked
    monkeypatch.setattr(fused, "kernels_for", lambda *a: fused.reference_kernels())
    with_kernels, kernels = _run(path, prompts)
    assert all(kernels[0][kind] > 0 for kind in ("rmsnorm", "rope", "silu_and_mul", "append_kv"))
    _assert_same(with_kernels, plain)


def test_deepseek_mla_keeps_its_latent_store_and_rope(make_model, stand_ins):
    path = make_model("deepseek_v3", num_layers=2, seed=5)
    prompts = random_prompts(2, 4, 16, seed=12)
    with_kernels, kernels = _run(path, prompts)
    assert kernels[0]["append_kv"] == 0 and kernels[0]["rmsnorm"] > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused, "kernels_for", lambda *a: None)
        plain, _ = _run(path, prompts)
    _assert_same(with_kernels, plain)


@pytest.mark.parametrize("algorithm", ["EAGLE3", "NEXTN"])
def test_speculative_engines_with_the_stand_ins_draft_and_accept_as_without(
    make_model, tmp_path, monkeypatch, algorithm
):
    if algorithm == "EAGLE3":
        target = make_model("llama", num_layers=3)
        # Layer 0's input (the embedding) captured: the first residual the fused norm adds into.
        draft = build_eagle_draft(str(tmp_path / "e3"), target, version=3, aux_layer_ids=[-1, 0, 1])
        spec = dict(speculative_draft_model_path=draft)
    else:
        # GLM-4.5: partial rotary, MoE with a shared expert, and its next-n layer as the draft.
        target = make_model(**FAMILIES["glm4_moe"])
        spec = {}
    spec.update(
        speculative_algorithm=algorithm,
        speculative_num_steps=2,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=3,
    )
    if algorithm == "NEXTN":  # eager (the MoE's graphs are slow to capture; EAGLE3 has them)
        spec.update(disable_cuda_graph=True)
    prompts = random_prompts(3, 4, 16, seed=13)
    plain, _ = _run(target, prompts, **spec)
    monkeypatch.setattr(fused, "kernels_for", lambda *a: fused.reference_kernels())
    with_kernels, kernels = _run(target, prompts, **spec)
    assert len(kernels) == 2 and kernels[1]["rmsnorm"] > 0
    _assert_same(with_kernels, plain)
