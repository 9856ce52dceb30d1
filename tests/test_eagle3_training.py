"""The trainer-side EAGLE-3 draft (trainer_bridge.eagle3_draft): its first step equals the engine's
own draft loaded from the same checkpoint, its training-time-test loss falls under Adam and
trains the draft alone, and what it saves the engine loads."""

from __future__ import annotations

import pytest
import torch

from spec_engine import Engine
from specrl.tiny_models import build_eagle_draft
from trainer_bridge.eagle3_draft import Eagle3Draft, ttt_loss

PROMPT = [17, 240, 33, 91, 5, 402, 77, 12, 300, 45, 8]
DRAFT_VOCAB = 96
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
    target features at each position with the next token's embedding)."""
    seen: dict[str, torch.Tensor] = {}
    runner = engine.scheduler.worker.draft
    forward = runner.model.draft_forward

    def record(embeds, positions, batch, hidden):
        to_logits, to_next = forward(embeds, positions, batch, hidden)
        if not seen:
            seen.update(
                embeds=embeds.clone(),
                positions=positions.clone(),
                aux=hidden.clone(),
                logits=runner.model.lm_head(to_logits).clone(),
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
        logits, nxt = draft.step(seen["embeds"][None], seen["aux"][None], seen["positions"], [])
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
        logits, _ = draft.step(seen["embeds"][None], seen["aux"][None], seen["positions"], [])
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
