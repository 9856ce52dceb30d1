"""Each CPU shim of trainer_bridge.megatron_compat, shown by the megatron code path it unblocks
(every test here raised "Torch not compiled with CUDA enabled", a NameError or an assertion
without its shim), plus the process-group helpers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from trainer_bridge.megatron_compat import apply_cpu_shims, model_parallel

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are for CPU-only runs"),
    # megatron's notices about absent Transformer Engine/apex and its own deprecations: not ours to
    # fix.
    pytest.mark.filterwarnings("ignore:::megatron"),
    pytest.mark.filterwarnings(
        "ignore:.*torch.jit.script_method:DeprecationWarning"
    ),  # megatron's decorators
]

H, V, T = 32, 128, 6


@pytest.fixture
def mp():
    with model_parallel(1, 1, seed=1234):
        yield


def _gpt(**overrides):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization="RMSNorm")
    return GPTModel(
        config, spec, vocab_size=V, max_sequence_length=64, position_embedding_type="rope"
    )


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(T).expand(2, T)


def test_apply_cpu_shims_is_idempotent(mp):
    patched = torch.cuda.current_device
    apply_cpu_shims()
    assert torch.cuda.current_device is patched
    assert torch.cuda.current_device() == torch.device("cpu")


def test_model_parallel_tears_down_process_groups():
    from megatron.core import parallel_state

    with model_parallel(1, 1):
        assert dist.get_backend() == "gloo"
        assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert not dist.is_initialized()
    assert not parallel_state.model_parallel_is_initialized()


def test_free_ports_lie_below_the_ephemeral_range_and_leave_the_global_generator_alone():
    """A port the kernel hands out for bind(0) can go to an outgoing socket (an earlier process
    group's gloo pairs) before a rendezvous listens on it: ours come from below that range."""
    import random
    import socket

    from trainer_bridge.megatron_compat import FIRST_PORT, _ephemeral_low, free_port

    random.seed(7)
    want = random.random()
    random.seed(7)
    ports = {free_port() for _ in range(20)}
    assert random.random() == want
    assert all(FIRST_PORT <= p < _ephemeral_low() for p in ports) and len(ports) > 1
    port = ports.pop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free


def test_current_device_places_rotary_and_ddp_buffers_on_cpu(mp):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = _gpt()
    ids, pos = _batch()
    logits = model(ids, pos, None)  # rotary inv_freq is moved to torch.cuda.current_device()
    assert logits.shape == (2, T, V) and torch.isfinite(logits).all()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    assert {b.grad_data.device.type for b in ddp.buffers} == {"cpu"}


def test_default_causal_mask_is_built_on_cpu(mp):
    from megatron.core.transformer.utils import get_default_causal_mask

    assert torch.equal(get_default_causal_mask(4), torch.ones(4, 4).triu(1).bool())


def test_rng_tracker_forks_reproducible_cpu_streams(mp):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    def draw() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model_parallel_cuda_manual_seed(7)
        torch.manual_seed(0)
        with get_cuda_rng_tracker().fork():
            tp_stream = torch.rand(4)
        with get_cuda_rng_tracker().fork("data-parallel-rng"):
            dp_stream = torch.rand(4)
        return tp_stream, dp_stream, torch.rand(4)

    tp_stream, dp_stream, outside = draw()
    again = draw()
    assert all(torch.equal(a, b) for a, b in zip((tp_stream, dp_stream, outside), again))
    assert not torch.equal(tp_stream, dp_stream)
    torch.manual_seed(0)
    assert torch.equal(outside, torch.rand(4)), (
        "a fork must leave the default generator where it was"
    )


def test_activation_recompute_replays_dropout(mp):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    dropout = dict(hidden_dropout=0.3, attention_dropout=0.3)
    plain = _gpt(**dropout)
    recomputed = _gpt(
        **dropout, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    recomputed.load_state_dict(plain.state_dict())
    ids, pos = _batch()
    grads = []
    for model in (plain, recomputed):
        model_parallel_cuda_manual_seed(3)
        torch.manual_seed(3)
        model(ids, pos, None).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6, msg=name)


def test_moe_router_runs_without_transformer_engine(mp):
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    x = torch.randn(5, H, requires_grad=True)
    w = torch.randn(4, H, requires_grad=True)
    out = router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(out, x @ w.T)
    out.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(5, H))
    # A MoE layer trains too (router gating backward, load-balancing loss).
    model = _gpt(
        num_moe_experts=2,
        moe_router_topk=2,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01,
    )
    model(*_batch(), None).mean().backward()
    router = model.decoder.layers[0].mlp.router.weight
    assert router.grad is not None and torch.isfinite(router.grad).all()


def _train_step(clip_grad: float):
    """One megatron training step (DDP, forward_backward_no_pipelining, fp32 SGD optimizer with
    clipping)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = _gpt()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="sgd",
            lr=1.0,
            sgd_momentum=0.0,
            weight_decay=0.0,
            bf16=False,
            clip_grad=clip_grad,
        ),
        [ddp],
    )
    ids, pos = _batch()

    def forward_step(data_iterator, model):
        logits = model(ids, pos, None)
        return logits, lambda out: (out.square().mean(), {"loss": out.square().mean().detach()})

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        expected_loss = model(ids, pos, None).square().mean()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=[ddp],
        num_microbatches=1,
        seq_length=T,
        micro_batch_size=2,
        forward_only=False,
    )
    grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    ok, grad_norm, _ = optimizer.step()
    delta = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    return expected_loss, losses, grads, ok, grad_norm, delta


def test_forward_backward_no_pipelining_and_clipped_step(mp):
    expected_loss, losses, grads, ok, grad_norm, delta = _train_step(clip_grad=1e-3)
    torch.testing.assert_close(losses[0]["loss"], expected_loss)
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])
    ).item()
    assert ok
    assert grad_norm == pytest.approx(norm, rel=1e-5)
    assert norm > 1e-2, "the step must need clipping for this test to mean anything"
    # SGD with lr 1: the update is -grad * clip / norm, so its global norm is the clip value.
    step = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(d) for d in delta.values()])
    ).item()
    assert step == pytest.approx(1e-3, rel=1e-3)
    for name, d in delta.items():
        torch.testing.assert_close(d, -grads[name] * 1e-3 / (norm + 1e-6), msg=name)


def test_dist_checkpointing_saves_and_loads_a_model_on_cpu(mp, tmp_path):
    """The torch_dist writer stages tensors with non_blocking copies and then calls
    torch.cuda.synchronize; the shim makes that a no-op, so --save works on CPU."""
    from megatron.core import dist_checkpointing

    model = _gpt()
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path))
    other = _gpt()
    assert not torch.equal(
        other.embedding.word_embeddings.weight, model.embedding.word_embeddings.weight
    )
    other.load_state_dict(dist_checkpointing.load(other.sharded_state_dict(), str(tmp_path)))
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
