"""Sequence packing in the trainer (--qkv-format thd): a micro batch's sequences concatenated into
one row with cu_seqlens give the padded layout's log-probs, losses (the MTP loss included) and
every parameter's gradient, on MiMo (Qwen2 + an MTP layer), Llama (GQA, llama3 rope), GLM-4.5
MoE (with routing replay and an MTP layer) and DeepSeek-V3 (MLA, YaRN); the packed core attention
equals megatron's own attention run on each sequence alone; what packing cannot do is refused."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import FAMILIES, random_prompts
from trainer_bridge.batch import TrainBatch
from trainer_bridge.loss import LossConfig
from trainer_bridge.options import TrainerArgs

pytestmark = [
    pytest.mark.filterwarnings("ignore:::megatron"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU megatron tests"),
]
pytest.importorskip("megatron.core")

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
}
# checkpoint kwargs per family (None: the MiMo model of the tiny RL run)
MODELS = {
    "mimo": None,
    "llama": FAMILIES["llama"],
    "glm4_moe": FAMILIES["glm4_moe"],
    "deepseek_v3": dict(
        arch="deepseek_v3",
        num_layers=3,
        extra_config={"rope_scaling": YARN, "num_nextn_predict_layers": 1},
    ),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def actor(request, make_model, rl_task):
    """A packing TrainActor (its models take both layouts: without packed_seq_params the packed
    attention is megatron's own), with the MTP loss where the model has MTP layers, the KL
    reference model and an entropy term in the loss, and MoE routing replayed."""
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.megatron_compat import destroy_model_parallel

    kwargs = MODELS[request.param]
    path = rl_task[0] if kwargs is None else make_model(**kwargs)
    moe = request.param == "glm4_moe"
    args = TrainerArgs(
        hf_checkpoint=path,
        lr=1e-3,
        micro_batch_size=3,
        global_batch_size=4,  # two optimizer steps, micro batches of 3 and 1
        enable_mtp_training=request.param in ("mimo", "glm4_moe"),
        use_rollout_routing_replay=moe,
        qkv_format="thd",
    )
    loss = LossConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    a = TrainActor(args, loss, temperature=0.8)
    yield a
    destroy_model_parallel()


def ragged_batch(actor) -> TrainBatch:
    """8 sequences of 3..23 tokens (prompt + response), in groups of 2 with different rewards;
    MoE models get random routed experts for routing replay."""
    g = torch.Generator(device="cpu").manual_seed(7)
    prompts = random_prompts(8, 2, 17, seed=8)
    responses = torch.randint(1, 7, (8,), generator=g, device="cpu").tolist()
    tokens = [
        p + torch.randint(5, 500, (n,), generator=g).tolist() for p, n in zip(prompts, responses)
    ]
    batch = TrainBatch(
        tokens, responses, [0.0, 1.0, 1.0, 0.0, 0.5, 0.0, 1.0, 0.2], n_samples_per_prompt=2
    )
    arch = actor.arch
    if actor.args.use_rollout_routing_replay:
        scores = torch.rand(8, 24, arch.num_hidden_layers, arch.moe.num_experts, generator=g)
        top = scores.topk(arch.moe.top_k, dim=-1).indices.to(torch.int32)
        batch.rollout_routed_experts = [top[i, : len(t) - 1] for i, t in enumerate(tokens)]
    return batch


def in_layout(actor, qkv_format: str, run, *args):
    """run(*args) with the actor's micro batches laid out as `qkv_format`."""
    saved = actor.args.qkv_format
    actor.args.qkv_format = qkv_format
    try:
        return run(*args)
    finally:
        actor.args.qkv_format = saved


def test_packed_log_probs_equal_padded(actor):
    """(The KL reference model's log-probs take the same path: the RL case of the next test
    compares them through the KL term.)"""
    batch = ragged_batch(actor)
    padded = in_layout(actor, "bshd", actor.compute_log_probs, batch)
    packed = in_layout(actor, "thd", actor.compute_log_probs, batch)
    assert [len(x) for x in packed] == batch.response_lengths
    diff = max(abs(a - b) for x, y in zip(padded, packed) for a, b in zip(x, y))
    assert diff < 1e-5, diff


def train_without_stepping(actor, train, batch: TrainBatch):
    """(metrics, [per optimizer step: {parameter: gradient}]) of train(batch) with the optimizer's
    step replaced by a record of the gradients it would apply (the weights stay as they are)."""
    steps = []

    def record():
        steps.append(
            {n: p.main_grad.clone() for n, p in actor.gpt.named_parameters() if p.requires_grad}
        )
        return True, 1.0, None

    actor.optimizer.step = record
    try:
        metrics = train(batch)
    finally:
        del actor.optimizer.step  # the class's step again
    return metrics, steps


# The dense MTP model in both train paths; MoE with routing replay and an MTP layer in the RL one
# (Llama and MLA differ from these in the attention alone, which the log-probs test covers).
@pytest.mark.parametrize(
    "actor, mode", [("mimo", "rl"), ("mimo", "sft"), ("glm4_moe", "rl")], indirect=["actor"]
)
def test_packed_losses_and_gradients_equal_padded(actor, mode):
    batch = ragged_batch(actor)
    train = actor.train if mode == "rl" else actor.train_sft
    padded, padded_grads = in_layout(actor, "bshd", train_without_stepping, actor, train, batch)
    packed, packed_grads = in_layout(actor, "thd", train_without_stepping, actor, train, batch)
    assert len(packed_grads) == 2
    losses = [k for k in padded if k.startswith("train/") and k != "train/grad_norm"]
    assert "train/loss" in losses and ("train/mtp_loss" in losses) == actor.args.enable_mtp_training
    assert ("train/kl" in losses) == (mode == "rl")  # the reference model's log-probs, packed
    for key in losses:
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-6), key
    for want, got in zip(padded_grads, packed_grads):
        assert want.keys() == got.keys()
        scale = max(g.abs().max().item() for g in want.values())
        for name in want:
            err = (got[name] - want[name]).abs().max().item()
            assert err <= 1e-5 * scale, (name, err, scale)
    if actor.args.enable_mtp_training:  # the MTP layer learned from the packed batch too
        assert any(g.abs().sum() > 0 for n, g in packed_grads[0].items() if n.startswith("mtp."))


@pytest.mark.parametrize("actor", ["mimo"], indirect=True)
def test_packed_attention_equals_megatron_attention_per_sequence(actor):
    """Packed sequences of 5, 1 and 9 tokens plus a padding sequence of 3, GQA (4 heads over 2
    query groups): each output token and each input's gradient equal megatron's local
    DotProductAttention run on its sequence alone."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from trainer_bridge.micro_batches.packed_attention import PackedDotProductAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        attention_dropout=0.0,  # as the trainer's models (megatron's default is 0.1)
    )
    build = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    packed_attention = PackedDotProductAttention(config, **build)
    reference = DotProductAttention(config, **build)
    lengths = [5, 1, 9, 3]
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32, device="cpu")
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9
    )
    g = torch.Generator(device="cpu").manual_seed(3)
    q = torch.randn(18, 4, 16, generator=g, device="cpu", requires_grad=True)
    k = torch.randn(18, 2, 16, generator=g, device="cpu", requires_grad=True)
    v = torch.randn(18, 2, 16, generator=g, device="cpu", requires_grad=True)
    out = packed_attention(q, k, v, None, packed_seq_params=params)
    assert out.shape == (18, 64)
    weights = torch.randn(out.shape, generator=g, device="cpu")
    (out * weights).sum().backward()
    starts = cu[:-1].tolist()
    for start, n in zip(starts, lengths):
        seq = slice(start, start + n)
        # megatron's [s, b, heads, d] layout with b = 1; None mask: its causal mask
        q1, k1, v1 = (x.detach()[seq, None].clone().requires_grad_() for x in (q, k, v))
        want = reference(q1, k1, v1, None)[:, 0]
        torch.testing.assert_close(out[seq], want, rtol=1e-5, atol=1e-6)
        (want * weights[seq]).sum().backward()
        for x, x1 in ((q, q1), (k, k1), (v, v1)):
            torch.testing.assert_close(x.grad[seq], x1.grad[:, 0], rtol=1e-5, atol=1e-6)


def test_what_packing_cannot_do_is_refused():
    from specrl.train_options import parse_args

    with pytest.raises(ValueError, match="--qkv-format must be one of thd, bshd; got 'sbhd'"):
        TrainerArgs(hf_checkpoint="x", qkv_format="sbhd")
    run = ["--hf-checkpoint", "x", "--prompt-data", "p", "--rollout-batch-size", "4"]
    run += ["--num-rollout", "1", "--output-dir", "o", "--qkv-format", "thd"]
    assert parse_args(run).options.trainer.qkv_format == "thd"
    draft = ["--sglang-speculative-algorithm", "EAGLE3"]
    draft += ["--sglang-speculative-draft-model-path", "d", "--enable-draft-training"]
    with pytest.raises(SystemExit, match="--enable-draft-training with --qkv-format thd is not"):
        parse_args(run + draft)


@pytest.mark.parametrize("actor", ["mimo"], indirect=True)
def test_packed_attention_refuses_what_it_does_not_compute(actor):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from trainer_bridge.micro_batches.packed_attention import PackedDotProductAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, window_size=(8, 0)
    )
    with pytest.raises(ValueError, match="sliding-window attention; use --qkv-format bshd"):
        PackedDotProductAttention(
            config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
        )


def test_a_pack_restarts_positions_and_unpacks_to_the_padded_layout():
    """Rows of 3, 1 and 5 tokens packed to a multiple of 4: the padding is a 4th sequence,
    positions restart at every sequence, and per-token values come back in the padded layout,
    zero wherever the predicted token is not in the same sequence."""
    from trainer_bridge.micro_batches.layout import PackedMicroBatch

    tokens = torch.tensor(
        [[11, 12, 13, 0, 0], [21, 0, 0, 0, 0], [31, 32, 33, 34, 35]], device="cpu"
    )
    mb = PackedMicroBatch(tokens, [3, 1, 5], pad_multiple=4)
    assert mb.tokens.tolist() == [[11, 12, 13, 21, 31, 32, 33, 34, 35, 35, 35, 35]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 1, 2]]
    params = mb.packed_seq_params
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 3, 4, 9, 12]
    assert params.max_seqlen_q == params.max_seqlen_kv == mb.rotary_seq_len == 5
    scores = torch.arange(1.0, 12.0, device="cpu")[None]  # pack position p scores token p + 1
    assert mb.unpack(scores, 1).tolist() == [[1, 2, 0, 0], [0, 0, 0, 0], [5, 6, 7, 8]]
    assert mb.unpack(scores[:, :-1], 2).tolist() == [[1, 0, 0], [0, 0, 0], [5, 6, 7]]
    routes = torch.arange(15, device="cpu").view(3, 5, 1)  # a per-token [b, S, ...] tensor
    assert mb.pack(routes)[0, :, 0].tolist() == [0, 1, 2, 5, 10, 11, 12, 13, 14, 14, 14, 14]


@pytest.mark.parametrize("actor", ["mimo"], indirect=True)
def test_a_pack_padded_for_tensor_parallelism_scores_as_the_padded_rows(actor):
    """The padding sequence slime adds for tensor parallelism (here to a multiple of 16)
    changes no sequence's log-probs."""
    from trainer_bridge import loss as losses
    from trainer_bridge.batch import pad_batch
    from trainer_bridge.micro_batches.layout import PackedMicroBatch, PaddedMicroBatch

    batch = ragged_batch(actor).select(range(3))
    tokens, mask, _ = pad_batch(batch, actor.device)
    lengths = [len(t) for t in batch.tokens]
    assert sum(lengths) % 16
    logps = []
    for mb in (PaddedMicroBatch(tokens), PackedMicroBatch(tokens, lengths, pad_multiple=16)):
        with torch.no_grad():
            logits, _ = actor._forward(mb)
        logps.append(mb.unpack(losses.token_log_probs(logits[:, :-1], mb.tokens[:, 1:]), 1))
    torch.testing.assert_close(logps[1] * mask, logps[0] * mask, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("actor", ["mimo"], indirect=True)
def test_vectorized_thd_rope_and_roll_equal_megatrons_per_sequence_definitions(actor):
    """(A packing actor installed them.) Rope: each sequence rotated by rows 0..len-1 of the
    frequency table, as megatron's bshd rope does it alone; roll: one token left within each
    sequence, its last position 0."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.parallel_state import get_context_parallel_group
    from megatron.core.transformer import multi_token_prediction

    for patched in (
        rope_utils._apply_rotary_pos_emb_thd,
        multi_token_prediction._roll_tensor_packed_seq,
    ):
        assert patched.__module__ == "trainer_bridge.micro_batches.thd_ops"
    cu = torch.tensor([0, 4, 5, 12], dtype=torch.int32, device="cpu")
    g = torch.Generator(device="cpu").manual_seed(5)
    t = torch.randn(12, 2, 8, generator=g, device="cpu")
    freqs = torch.randn(7, 1, 1, 8, generator=g, device="cpu")
    got = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=get_context_parallel_group())
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = end - start
        want = rope_utils._apply_rotary_pos_emb_bshd(t[start:end, None], freqs[:n])[:, 0]
        torch.testing.assert_close(got[start:end], want, rtol=0, atol=0)
    ids = torch.arange(1, 13, device="cpu")[None]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    rolled, total = multi_token_prediction.roll_tensor(ids, packed_seq_params=params)
    assert rolled.tolist() == [[2, 3, 4, 0, 0, 7, 8, 9, 10, 11, 12, 0]] and total == rolled.sum()


@pytest.mark.parametrize("layout", ["thd", "bshd"])
@pytest.mark.parametrize("actor", ["mimo"], indirect=True)
def test_dynamic_batch_size_trains_as_fixed_micro_batches(actor, layout):
    """--use-dynamic-batch-size --max-tokens-per-gpu 30: micro batches of 1-3 sequences of
    different sizes (each within the budget) give the log-probs, losses and gradients of the fixed
    --micro-batch-size; the MTP loss, a token mean per micro batch as megatron's, is left out."""
    batch = ragged_batch(actor)
    saved = actor.args.micro_batch_size
    reference = [
        in_layout(actor, layout, actor.compute_log_probs, batch),
        *in_layout(actor, layout, train_without_stepping, actor, actor.train, batch),
    ]
    sizes = []
    forward = actor._forward

    def counted(mb, *args, **kwargs):
        sizes.append(len(mb.unpack(mb.tokens, 0)))
        return forward(mb, *args, **kwargs)

    actor._forward = counted
    actor.args.use_dynamic_batch_size = True
    actor.args.max_tokens_per_gpu = actor.args.log_probs_max_tokens_per_gpu = 30
    actor.args.micro_batch_size = 1  # ignored
    try:
        dynamic = [
            in_layout(actor, layout, actor.compute_log_probs, batch),
            *in_layout(actor, layout, train_without_stepping, actor, actor.train, batch),
        ]
    finally:
        del actor._forward
        actor.args.use_dynamic_batch_size, actor.args.micro_batch_size = False, saved
        actor.args.max_tokens_per_gpu = actor.args.log_probs_max_tokens_per_gpu = None
    assert len(set(sizes)) > 1 and max(sizes) > 1, sizes
    (want_logp, want, want_grads), (got_logp, got, got_grads) = reference, dynamic
    diff = max(abs(a - b) for x, y in zip(want_logp, got_logp) for a, b in zip(x, y))
    assert [len(x) for x in got_logp] == batch.response_lengths and diff < 1e-5, diff
    keys = [k for k in want if k.startswith("train/") and k not in ("train/mtp_loss",)]
    for key in keys:
        if key != "train/grad_norm":
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    for w, g in zip(want_grads, got_grads):
        scale = max(x.abs().max().item() for x in w.values())
        for name in w:
            if not name.startswith("mtp."):
                assert (g[name] - w[name]).abs().max().item() <= 1e-5 * scale, name


def test_bench_packing_times_each_way_to_size_micro_batches(tmp_path):
    from tests.support.forkserver import run_main

    out = tmp_path / "packing.json"
    argv = ["--repeats", "1", "--batches", "tiny run", "--json", str(out)]
    # python -m scripts.bench_packing, forked from the server that has megatron imported
    proc = run_main("scripts.bench_packing", argv, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    # 32 sequences of at most 11 tokens (281 in all) in micro batches of 64 positions: 7 fixed
    # micro batches of 5 padded rows, fewer filled to the budget, fewest packed (>= 281 / 64)
    counts = [rows[c]["micro_batches"] for c in rows]
    assert counts[:3] == [1, 1, 7] and 5 <= counts[4] <= counts[3] <= 7, rows
    assert all(r["best_s"] > 0 and r["speedup"] > 0 for r in rows.values())
