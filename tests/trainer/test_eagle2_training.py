"""The trainer-side EAGLE-2 draft (trainer_bridge.drafts.eagle2): it computes what the engine's
draft computes from the same checkpoint, EAGLE's loss falls under Adam and trains the draft alone,
what it pushes or saves the engine takes, and --enable-draft-training runs it in the trainer on
the policy's final hidden states."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from spec_engine import Engine
from spec_engine.weights.updater import DRAFT_PREFIX
from tests.trainer.test_eagle3_training import PROMPT, engine_draft_extend
from tiny.checkpoints import build_eagle_draft
from trainer_bridge.drafts.eagle2 import Eagle2Draft, eagle_loss
from trainer_bridge.micro_batches.layout import PaddedMicroBatch
from trainer_bridge.weight_sync import WeightPusher, WeightSyncConfig

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def eagle2(make_model, tmp_path_factory) -> tuple[str, str]:
    # Two layers: the first without an input norm, the second with one.
    target = make_model("llama", num_layers=4)
    draft = build_eagle_draft(
        str(tmp_path_factory.mktemp("eagle2")), target, version=2, num_layers=2
    )
    return target, draft


@pytest.fixture(scope="module")
def engine(eagle2):
    target, draft = eagle2
    with Engine(
        model_path=target,
        random_seed=0,
        skip_tokenizer_init=True,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=draft,
        speculative_num_steps=2,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=3,
    ) as engine:
        yield engine


def drafted(draft: Eagle2Draft, seen: dict[str, torch.Tensor], head: torch.Tensor):
    """The trainer's draft on the engine's inputs: (logits through `head`, next features)."""
    with torch.no_grad():
        out = draft(seen["embeds"][None], seen["features"][None], seen["positions"])[0]
    return F.linear(out, head), out


def test_forward_equals_the_engines_draft(eagle2, engine):
    _, path = eagle2
    seen = engine_draft_extend(engine)
    runner = engine.scheduler.worker.draft
    assert runner.head is runner.target.model.lm_head  # EAGLE-2 drafts with the target's head
    draft = Eagle2Draft.from_pretrained(path, CPU)
    assert seen["positions"].tolist() == list(range(len(PROMPT)))
    logits, nxt = drafted(draft, seen, runner.head.weight)
    torch.testing.assert_close(nxt, seen["next"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, seen["logits"], atol=1e-5, rtol=1e-5)
    assert "layers.0.input_layernorm.weight" not in draft.state_dict()
    assert "layers.1.input_layernorm.weight" in draft.state_dict()


def learnable_batch(vocab: int, hidden: int) -> dict[str, torch.Tensor]:
    """A batch whose target features are a fixed random function of the token at each position
    (so the feature at t + 1 follows from token t + 1, which the draft reads), with logits the
    head's over them, as a target's are."""
    g = torch.Generator(device="cpu").manual_seed(0)
    b, s = 2, 10
    tokens = torch.randint(0, vocab, (b, s), generator=g, device="cpu")
    features = torch.randn(vocab, hidden, generator=g, device="cpu")[tokens]
    head = torch.randn(vocab, hidden, generator=g, device="cpu")
    mask = torch.zeros(b, s - 1, device="cpu")
    mask[:, 3:] = 1.0
    return {
        "embed_weight": torch.randn(vocab, hidden, generator=g, device="cpu") * 0.5,
        "head_weight": head,
        "tokens": tokens,
        "features": features,
        "target_logits": features @ head.T,
        "mask": mask,
    }


def test_loss_falls_reaches_the_draft_only_and_the_push_lands(eagle2, engine, tmp_path):
    """EAGLE's loss falls, its gradient reaches the draft's parameters alone; the trained draft,
    pushed under `draft.` names with --check-weight-update-equal, is what the engine drafts with,
    and a saved draft loads back into both."""
    _, path = eagle2
    draft = Eagle2Draft.from_pretrained(path, CPU)
    cfg = draft.config
    batch = learnable_batch(cfg.vocab_size, cfg.hidden_size)
    for name in ("embed_weight", "head_weight", "features"):
        batch[name].requires_grad_(True)
    optimizer = torch.optim.Adam(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss, parts = eagle_loss(draft, **batch)
        loss.backward()
        optimizer.step()
        losses.append((loss.item(), parts["feature"].item(), parts["token"].item()))
    total, feature, token = zip(*losses)
    assert total[-1] < 0.7 * total[0] and feature[-1] < feature[0] and token[-1] < token[0], losses
    assert all(batch[n].grad is None for n in ("embed_weight", "head_weight", "features"))
    assert all(p.grad is not None for p in draft.parameters())

    before = engine_draft_extend(engine)
    pusher = WeightPusher([engine], WeightSyncConfig(check_weight_update_equal=True))
    try:
        pusher.push(((DRAFT_PREFIX + n, t) for n, t in draft.hf_named_tensors()), "v1")
    finally:
        pusher.close()
    assert engine.get_server_info()["weight_version"] == "v1"
    seen = engine_draft_extend(engine)
    head = engine.scheduler.worker.draft.head.weight
    logits, nxt = drafted(draft, seen, head)
    torch.testing.assert_close(nxt, seen["next"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, seen["logits"], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(seen["next"], before["next"])  # the engine's drafts changed

    out = str(tmp_path / "trained")
    draft.save_pretrained(out, like=path)
    engine.update_weights_from_disk(out, component="draft")
    reloaded = Eagle2Draft.from_pretrained(out, CPU)
    for (name, a), (_, b) in zip(draft.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_policy_features_are_the_engines_and_the_trained_draft_lands(eagle2, engine, tmp_path):
    """--enable-draft-training with an EAGLE-2 draft: the megatron policy's final hidden states
    are the engine's EAGLE-2 features, train steps lower EAGLE's loss, a push carries the draft
    (not the target's embedding or head) under the policy's version, checked tensor by tensor,
    and the training checkpoint resumes the draft bit for bit."""
    pytest.importorskip("megatron.core")
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    target, path = eagle2
    seen = engine_draft_extend(engine)
    args = TrainerArgs(
        hf_checkpoint=target,
        lr=1e-6,
        enable_draft_training=True,
        draft_checkpoint=path,
        draft_lr=1e-2,
    )
    actor = TrainActor(args)
    try:
        with torch.no_grad():
            actor._forward(PaddedMicroBatch(torch.tensor([PROMPT], device="cpu")))
        features = actor.online_draft.capture.features()[0]
        torch.testing.assert_close(features, seen["features"], atol=1e-4, rtol=1e-4)

        tokens = [PROMPT + [7 + i, 9, 11, 13, 15, 17] for i in range(4)]
        batch = TrainBatch(tokens, [6] * 4, [1.0, 0.0, 1.0, 0.0], n_samples_per_prompt=4)
        rows = [actor.train(batch) for _ in range(2)]
        losses = [r["train/draft_loss"] for r in rows]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0], losses
        assert {"train/draft_loss/feature", "train/draft_loss/token"} <= set(rows[0])

        pushed = [n for n, _ in actor.online_draft.with_draft(iter(()))]
        assert pushed and all(n.startswith(("draft.fc.", "draft.layers.")) for n in pushed)
        actor.push_weights([engine], WeightSyncConfig(check_weight_update_equal=True), "v2")
        assert engine.get_server_info()["weight_version"] == "v2"
        trained = actor.online_draft.draft.fc.weight
        assert torch.equal(engine.scheduler.worker.draft.model.fc.weight, trained)
        assert not torch.equal(trained, Eagle2Draft.from_pretrained(path, CPU).fc.weight)

        # The training checkpoint: a draft step from it repeats bit for bit, Adam's moments
        # included (policy forward and draft step alone: no policy step between them).
        online = actor.online_draft
        tokens_t = torch.tensor(tokens, device="cpu")
        mask = torch.zeros(4, tokens_t.shape[1] - 1, device="cpu")
        mask[:, -6:] = 1.0

        def draft_step() -> dict[str, torch.Tensor]:
            with torch.no_grad():
                logits, _ = actor._forward(PaddedMicroBatch(tokens_t))
            online.backward(tokens_t, logits, mask, 1.0)
            online.step()
            return {n: t.clone() for n, t in online.draft.state_dict().items()}

        ckpt = str(tmp_path / "iter_0000001")
        os.makedirs(ckpt)
        actor.save_checkpoint(ckpt, 1)
        expected = draft_step()
        actor.load_checkpoint(ckpt)
        got = draft_step()
        assert all(torch.equal(got[n], t) for n, t in expected.items())
    finally:
        destroy_model_parallel()
