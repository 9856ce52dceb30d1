"""The trainer-side EAGLE-3 draft (trainer_bridge.drafts.eagle3): its first step equals the engine's
own draft loaded from the same checkpoint, its training-time-test loss falls under Adam and
trains the draft alone, and what it saves the engine loads."""

from __future__ import annotations

import os

import pytest
import torch

from spec_engine import Engine
from tiny.checkpoints import build_eagle_draft
from trainer_bridge.drafts.eagle3 import Eagle3Draft, ttt_loss
from trainer_bridge.micro_batches.layout import PaddedMicroBatch

PROMPT = [17, 240, 33, 91, 5, 402, 77, 12, 300, 45, 8]
DRAFT_VOCAB = 96
DRAFT = ["--sglang-speculative-draft-model-path", "draft"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def eagle3(make_model, tmp_path_factory) -> tuple[str, str]:
    target = make_model("llama", num_layers=4)
    draft = build_eagle_draft(
        str(tmp_path_factory.mktemp("eagle3")), target, version=3, draft_vocab_size=DRAFT_VOCAB
    )
    return target, draft


@pytest.fixture(scope="module")
def engine(eagle3):
    target, draft = eagle3
    with Engine(
        model_path=target,
        random_seed=0,
        skip_tokenizer_init=True,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft,
        speculative_num_steps=2,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=3,
    ) as engine:
        yield engine


def engine_draft_extend(engine: Engine) -> dict[str, torch.Tensor]:
    """Inputs and outputs of the engine's draft forward over PROMPT's prefill (the draft extend:
    target features at each position with the next token's embedding), logits through the head
    the engine drafts with."""
    seen: dict[str, torch.Tensor] = {}
    runner = engine.scheduler.worker.draft
    forward = runner.model.draft_forward

    def record(embeds, positions, batch, hidden):
        to_logits, to_next = forward(embeds, positions, batch, hidden)
        if not seen:
            seen.update(
                embeds=embeds.clone(),
                positions=positions.clone(),
                features=hidden.clone(),
                logits=runner.head(to_logits).clone(),
                next=to_next.clone(),
            )
        return to_logits, to_next

    runner.model.draft_forward = record
    try:
        engine.flush_cache()  # the whole prompt through the draft, not a cached prefix
        engine.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 1})
    finally:
        del runner.model.draft_forward
    return seen


def test_first_step_equals_the_engines_draft(eagle3, engine):
    _, path = eagle3
    seen = engine_draft_extend(engine)
    draft = Eagle3Draft.from_pretrained(path, CPU)
    assert seen["positions"].tolist() == list(range(len(PROMPT)))
    with torch.no_grad():
        logits, nxt = draft.step(
            seen["embeds"][None], seen["features"][None], seen["positions"], []
        )
    torch.testing.assert_close(logits[0], seen["logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nxt[0], seen["next"], atol=1e-5, rtol=1e-5)


def fixed_batch(draft: Eagle3Draft, vocab: int, hidden: int) -> dict[str, torch.Tensor]:
    """A batch whose teacher is a fixed random function of the next token, so the draft can learn
    it: the target's argmax lies in the draft vocabulary."""
    g = torch.Generator(device="cpu").manual_seed(0)
    b, s = 2, 10
    tokens = torch.randint(0, vocab, (b, s), generator=g, device="cpu")
    table = torch.randn(vocab, vocab, generator=g, device="cpu") * 3
    table[:, draft.hot_token_ids()] += 4.0
    mask = torch.zeros(b, s - 1, device="cpu")
    mask[:, 3:] = 1.0
    return {
        "embed_weight": torch.randn(vocab, hidden, generator=g, device="cpu") * 0.5,
        "tokens": tokens,
        "aux": torch.randn(b, s, 3 * hidden, generator=g, device="cpu"),
        "target_logits": table[tokens],
        "mask": mask,
    }


def test_loss_falls_and_reaches_the_draft_only(eagle3, engine, tmp_path):
    _, path = eagle3
    draft = Eagle3Draft.from_pretrained(path, CPU)
    cfg = draft.config
    batch = fixed_batch(draft, cfg.vocab_size, cfg.hidden_size)
    batch["embed_weight"].requires_grad_(True)
    batch["aux"].requires_grad_(True)
    optimizer = torch.optim.Adam(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss, per_step = ttt_loss(draft, **batch, length=3)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        assert len(per_step) == 3 and all(torch.isfinite(x) for x in per_step)
    assert losses[-1] < 0.7 * losses[0], losses
    # The target's features and embedding are constants of the draft's loss.
    assert batch["embed_weight"].grad is None and batch["aux"].grad is None
    assert all(p.grad is not None for p in draft.parameters())

    # Saved back, the trained draft is what the engine loads and drafts with.
    out = str(tmp_path / "trained")
    draft.save_pretrained(out, like=path)
    engine.update_weights_from_disk(out, component="draft")
    seen = engine_draft_extend(engine)
    with torch.no_grad():
        logits, _ = draft.step(seen["embeds"][None], seen["features"][None], seen["positions"], [])
    torch.testing.assert_close(logits[0], seen["logits"], atol=1e-5, rtol=1e-5)
    reloaded = Eagle3Draft.from_pretrained(out, CPU)
    for (name, a), (_, b) in zip(draft.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_later_steps_attend_to_earlier_keys(eagle3):
    """Step k at position t sees step 0's keys up to t - k and its own earlier steps' keys at t:
    changing position t's step-0 input changes step 1 at t + 1 but not at t."""
    _, path = eagle3
    draft = Eagle3Draft.from_pretrained(path, CPU)
    h = draft.config.hidden_size
    g = torch.Generator(device="cpu").manual_seed(1)
    embeds = torch.randn(1, 6, h, generator=g, device="cpu")
    aux = torch.randn(1, 6, 3 * h, generator=g, device="cpu")
    positions = torch.arange(6, device="cpu")

    def second_step(aux: torch.Tensor) -> torch.Tensor:
        cache: list = []
        with torch.no_grad():
            _, hidden = draft.step(embeds, aux, positions, cache)
            _, hidden = draft.step(embeds, hidden, positions + 1, cache)
        return hidden[0]

    before = second_step(aux)
    changed = aux.clone()
    changed[0, 2] += 1.0
    after = second_step(changed)
    assert torch.equal(before[:2], after[:2])  # earlier positions never see position 2
    assert not torch.allclose(before[2], after[2])  # its own chain: step 0 at 2 feeds step 1 at 2
    assert not torch.allclose(before[3], after[3])  # step 0's key at 2 is visible from 3 on


def test_policy_features_match_the_engines_and_the_pushed_draft_lands(eagle3, engine, tmp_path):
    """--enable-draft-training in the trainer: the hooks on the megatron policy capture what the
    engine's EAGLE-3 target captures; train steps lower the draft's loss; a push carries the
    draft to the engine under the policy's version, checked tensor by tensor
    (--check-weight-update-equal); the training checkpoint resumes the draft bit for bit."""
    pytest.importorskip("megatron.core")
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs
    from trainer_bridge.weight_sync import WeightSyncConfig

    target, path = eagle3
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
        losses = [actor.train(batch)["train/draft_loss"] for _ in range(6)]
        assert all(torch.isfinite(torch.tensor(losses))), losses
        # Soft targets: the floor is the teacher's entropy, so the fall is modest.
        assert losses[-1] < 0.9 * losses[0], losses
        metrics = actor.train(batch)
        assert len([k for k in metrics if k.startswith("train/draft_loss/step_")]) == 7

        actor.push_weights([engine], WeightSyncConfig(check_weight_update_equal=True), "v1")
        assert engine.get_server_info()["weight_version"] == "v1"
        trained = actor.online_draft.draft.fc.weight
        assert torch.equal(engine.scheduler.worker.draft.model.fc.weight, trained)
        assert not torch.equal(trained, Eagle3Draft.from_pretrained(path, CPU).fc.weight)

        ckpt = str(tmp_path / "iter_0000001")
        os.makedirs(ckpt)
        actor.save_checkpoint(ckpt, 1)
        actor.train(batch)
        expected = {n: t.clone() for n, t in actor.online_draft.draft.state_dict().items()}
        actor.load_checkpoint(ckpt)  # back to before that step: the same step again
        actor.train(batch)
        got = actor.online_draft.draft.state_dict()
        assert all(torch.equal(got[n], t) for n, t in expected.items())
        # A run resumed with another --draft-lr takes it, not the checkpoint's: at 0 it freezes.
        for group in actor.online_draft.optimizer.param_groups:
            group["lr"] = 0.0
        actor.load_checkpoint(ckpt)
        actor.train(batch)
        frozen = actor.online_draft.draft.state_dict()
        saved = torch.load(os.path.join(ckpt, "common.pt"), weights_only=False)["draft"]["model"]
        assert all(torch.equal(frozen[n], t) for n, t in saved.items())
    finally:
        destroy_model_parallel()


def test_tiny_rl_run_trains_the_eagle3_draft(rl_task, tmp_path):
    """scripts.train with --enable-draft-training: every rollout logs a finite draft loss, and
    --check-weight-update-equal checks the engine's draft against the trainer's after each push."""
    pytest.importorskip("ray")
    from tests.e2e.test_train_loop import base_args, metrics, run

    model, data = rl_task
    draft = build_eagle_draft(str(tmp_path / "eagle3"), model, version=3, draft_vocab_size=64)
    out = str(tmp_path / "run")
    args = base_args(model, data, out) + [
        "--rollout-batch-size",
        "1",
        "--lr",
        "1e-5",
        "--enable-draft-training",
        "--draft-lr",
        "1e-2",
        "--check-weight-update-equal",
        "--sglang-speculative-algorithm",
        "EAGLE3",
        "--sglang-speculative-draft-model-path",
        draft,
        "--sglang-speculative-num-steps",
        "2",
        "--sglang-speculative-eagle-topk",
        "1",
        "--sglang-disable-cuda-graph",
    ]
    run(args)
    rows = metrics(out)
    losses = [r["train/draft_loss"] for r in rows]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    assert all(r["train/draft_loss/step_6"] is not None for r in rows)
    assert [r["rollout/weight_version"] for r in rows] == [0, 1]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--sglang-speculative-algorithm", "EAGLE"], "which train with --enable-mtp-training"),
        (["--sglang-speculative-algorithm", "NEXTN"], "which train with --enable-mtp-training"),
        (["--sglang-speculative-algorithm", "STANDALONE"], "it needs the draft LM"),
        (["--sglang-speculative-algorithm", "NGRAM"], "NGRAM drafts from an n-gram cache"),
        ([], "is None: no draft model runs"),
        (["--sglang-speculative-algorithm", "EAGLE3", *DRAFT, "--debug-rollout-only"], "has none"),
        (
            ["--sglang-speculative-algorithm", "EAGLE3", *DRAFT, "--enable-mtp-training"],
            "--enable-mtp-training each train",
        ),
    ],
)
def test_draft_training_refuses_what_it_cannot_do(extra, needle, capsys):
    from specrl.train_options import parse_args

    argv = ["--hf-checkpoint", "m", "--prompt-data", "d", "--rollout-batch-size", "1"]
    argv += ["--num-rollout", "1", "--output-dir", "o", "--enable-draft-training", *extra]
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    message = str(e.value) + capsys.readouterr().err
    assert needle in message
    if "--sglang-speculative-algorithm" in extra and "EAGLE3" not in extra:
        assert "give EAGLE, EAGLE3 or STANDALONE with its draft" in message


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
def test_draft_training_takes_eagle2_eagle3_and_standalone_drafts(algorithm):
    from specrl.train_options import build_parser, check_draft_training

    argv = ["--hf-checkpoint", "m", "--prompt-data", "d", "--rollout-batch-size", "1"]
    argv += ["--num-rollout", "1", "--output-dir", "o", "--enable-draft-training"]
    argv += ["--sglang-speculative-algorithm", algorithm, *DRAFT]
    check_draft_training(build_parser().parse_args(argv))
