"""Routing replay on the trainer (slime's R3, --use-rollout-routing-replay): the rollout's
default generate function asks the engine for each token's routed experts and decodes them onto
the Sample and the TrainBatch; the TrainActor's megatron routers then take the engine's experts
in every forward (log-probs and train steps). Checked against the engine itself: its log-probs
and, via a hook on each megatron router, its expert choice for every token, also after the
trainer's expert bias is moved so that its own top-k differs from the engine's."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import torch

from rollout.generate import generate
from rollout.sample import Sample
from spec_engine import Engine
from specrl.train_batch import to_train_batch
from tests.conftest import FAMILIES, random_prompts

pytestmark = [
    pytest.mark.filterwarnings("ignore:::megatron"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU megatron tests"),
]
pytest.importorskip("megatron.core")
N_PROMPTS, N = 2, 2  # prompts of different lengths: right padding inside a micro batch
MOE_LAYERS = [1, 2]  # the tiny GLM: layer 0 dense


@pytest.fixture(scope="module")
def glm(make_model) -> str:
    return make_model(**FAMILIES["glm4_moe"])


class _Replayed:
    """The engine's outputs served back through rollout.generate's engine interface."""

    def __init__(self, outputs: list[dict]) -> None:
        self.outputs, self.asked = iter(outputs), []

    async def async_generate(self, **kwargs):
        self.asked.append(kwargs)
        return next(self.outputs)


def rollout_batch(glm: str, prompts: list[list[int]], **engine_kwargs) -> tuple:
    """Rollout groups of `prompts` from an engine (`engine_kwargs`) -> rollout.generate ->
    to_train_batch; with the engine's log-probs of each sample."""
    params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "n": N}
    with Engine(
        model_path=glm, random_seed=5, enable_return_routed_experts=True, **engine_kwargs
    ) as engine:
        outs = engine.generate(
            input_ids=prompts, sampling_params=params, return_logprob=True,
            return_routed_experts=True,
        )  # fmt: skip
    served = _Replayed(outs)
    args = argparse.Namespace(use_rollout_routing_replay=True, hf_checkpoint=glm)

    async def run() -> list[Sample]:
        samples = [Sample(index=i, tokens=list(prompts[i // N])) for i in range(len(outs))]
        return [await generate(args, s, {}, served) for s in samples]

    samples = asyncio.run(run())
    assert all(kw["return_routed_experts"] for kw in served.asked)
    for s in samples:
        s.reward = 1.0 if s.index % 2 else 0.0
    out = to_train_batch([samples[i : i + N] for i in range(0, len(samples), N)])
    logps = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    return out, logps


@pytest.fixture(scope="module")
def batch(glm):
    return rollout_batch(glm, random_prompts(N_PROMPTS, 5, 11, seed=41))


@pytest.fixture(scope="module")
def actor(glm):
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    a = TrainActor(
        TrainerArgs(hf_checkpoint=glm, lr=1e-4, micro_batch_size=3, use_rollout_routing_replay=True)
    )
    yield a
    destroy_model_parallel()


class _Routing:
    """Every megatron router's chosen experts per forward: [b, s, MoE layers, experts] bools."""

    def __init__(self, gpt) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in gpt.decoder.modules() if isinstance(m, TopKRouter)]
        self.maps: list[torch.Tensor] = []

    def __enter__(self) -> _Routing:
        self.hooks = [
            r.register_forward_hook(lambda _m, inp, out: self.maps.append((inp[0].shape, out[1])))
            for r in self.routers
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()

    def forwards(self) -> list[torch.Tensor]:
        out = []
        for i in range(0, len(self.maps), len(self.routers)):
            layers = [
                m.view(shape[0], shape[1], -1) for shape, m in self.maps[i : i + len(self.routers)]
            ]
            out.append(torch.stack(layers, dim=2).transpose(0, 1))  # [s, b] -> [b, s]
        return out


def engine_map(batch, rows: list[int], experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's routing of `rows` as [b, s, MoE layers, experts] bools, and which positions
    it forwarded."""
    width = max(len(batch.tokens[r]) for r in rows)
    want = torch.zeros(len(rows), width, len(MOE_LAYERS), experts, dtype=torch.bool, device="cpu")
    real = torch.zeros(len(rows), width, dtype=torch.bool, device="cpu")
    for i, r in enumerate(rows):
        ids = batch.rollout_routed_experts[r][:, MOE_LAYERS].long()
        want[i, : len(ids)].scatter_(-1, ids, True)
        real[i, : len(ids)] = True
    return want, real


def assert_engine_routing(seen: list[torch.Tensor], batch, experts: int, equal: bool) -> None:
    mbs = seen[0].shape[0]
    same = []
    for k, got in enumerate(seen):
        rows = list(range(k * mbs, min((k + 1) * mbs, len(batch))))
        want, real = engine_map(batch, rows, experts)
        same.append((got[:, : want.shape[1]] == want).all(-1).all(-1)[real])
    assert bool(torch.cat(same).all()) is equal


def test_replayed_log_probs_and_routing_are_the_engines(actor, batch):
    train_batch, engine_logps = batch
    experts = actor.arch.moe.num_experts
    with _Routing(actor.gpt) as routing:
        got = actor.compute_log_probs(train_batch)
    flat = lambda xs: torch.tensor([v for x in xs for v in x], dtype=torch.float32)  # noqa: E731
    torch.testing.assert_close(flat(got), flat(engine_logps), rtol=0, atol=1e-4)
    assert_engine_routing(routing.forwards(), train_batch, experts, equal=True)


def test_replay_overrides_a_router_that_disagrees(actor, batch):
    """The trainer's expert bias moved: its own top-k leaves the engine's (no replay), while the
    replayed log-prob forward and train step still route as the engine did."""
    train_batch, _ = batch
    experts = actor.arch.moe.num_experts
    routers = _Routing(actor.gpt).routers
    saved = [r.expert_bias.clone() for r in routers]
    gen = torch.Generator(device="cpu").manual_seed(0)
    for r in routers:
        r.expert_bias.add_(
            torch.randn(experts, generator=gen, device="cpu").to(r.expert_bias) * 0.3
        )
    try:
        from trainer_bridge.batch import pad_batch
        from trainer_bridge.micro_batches.layout import PaddedMicroBatch

        tokens, _, _ = pad_batch(train_batch, actor.device)
        with _Routing(actor.gpt) as own, torch.no_grad():
            actor._forward(PaddedMicroBatch(tokens))
        assert_engine_routing(own.forwards(), train_batch, experts, equal=False)
        with _Routing(actor.gpt) as replay:
            actor.compute_log_probs(train_batch)
        assert_engine_routing(replay.forwards(), train_batch, experts, equal=True)
        with _Routing(actor.gpt) as step:
            metrics = actor.train(train_batch)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
        # micro batches of 3 + 1 rows: the old log-probs' two forwards, then the train step's
        forwards = step.forwards()
        assert len(forwards) == 4
        assert_engine_routing(forwards[:2], train_batch, experts, equal=True)
        assert_engine_routing(forwards[2:], train_batch, experts, equal=True)
    finally:
        for r, bias in zip(routers, saved):
            r.expert_bias.copy_(bias)


def test_what_cannot_replay_is_refused(make_model, glm):
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.options import TrainerArgs

    llama = make_model(**FAMILIES["llama"])
    with pytest.raises(ValueError, match="dense model with no router"):
        TrainActor(TrainerArgs(hf_checkpoint=llama, use_rollout_routing_replay=True))
    with pytest.raises(ValueError, match="--use-routing-replay alone"):
        TrainerArgs(hf_checkpoint=glm, use_routing_replay=True)
    assert TrainerArgs(hf_checkpoint=glm, use_rollout_routing_replay=True).use_routing_replay


def test_the_launcher_turns_the_engines_reporting_on(glm):
    from specrl.train_options import parse_args

    common = ["--hf-checkpoint", glm, "--rollout-batch-size", "1", "--num-rollout", "1"]
    args = parse_args([*common, "--output-dir", "/tmp/unused", "--use-rollout-routing-replay"])
    assert args.options.engine.enable_return_routed_experts
