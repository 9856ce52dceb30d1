"""--enable-draft-training with a STANDALONE draft (trainer_bridge.drafts.standalone): the trainer's
draft computes what the engine's STANDALONE draft computes (a tied head, a vocabulary padded past
the policy's), distillation from the policy lowers KL(policy || draft) and raises the engine's
accept length once pushed, the trainer distills it on its own policy's logits and checkpoints it,
and what cannot train is refused."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from spec_engine import Engine
from spec_engine.weights.updater import DRAFT_PREFIX
from tests.conftest import random_prompts
from trainer_bridge.drafts.eagle2 import EAGLE2_ARCHITECTURE as EAGLE2
from trainer_bridge.drafts.standalone import StandaloneDraft, check_vocabulary, distill_loss
from trainer_bridge.micro_batches.layout import PaddedMicroBatch
from trainer_bridge.weight_sync import WeightPusher, WeightSyncConfig

CPU = torch.device("cpu")
POLICY_VOCAB = 512
PROMPTS = random_prompts(4, 6, 6, seed=61)  # one length: the batch needs no padding
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def standalone(make_model) -> tuple[str, str]:
    """A Qwen2 policy and a smaller Qwen2 draft of the same tokenizer, with a tied head and 8
    padding rows past the policy's vocabulary. The policy's head is its own: a tiny random model
    with a tied one mostly repeats its last token, which any draft learns."""
    policy = make_model("qwen2", num_layers=2, seed=1)
    draft = make_model(
        "qwen2", num_layers=1, hidden_size=32, vocab_size=520, tie_word_embeddings=True, seed=7
    )
    return policy, draft


@pytest.fixture(scope="module")
def engine(standalone):
    policy, draft = standalone
    with Engine(
        model_path=policy,
        random_seed=0,
        skip_tokenizer_init=True,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=draft,
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
    ) as engine:
        yield engine


def engine_draft_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """The engine's draft logits over `prompt` (its first forward: the prompt's extend)."""
    seen: list[torch.Tensor] = []
    runner = engine.scheduler.worker.draft
    forward = runner.model.draft_forward

    def record(embeds, positions, batch, hidden):
        to_logits, to_next = forward(embeds, positions, batch, hidden)
        if not seen:
            assert positions.tolist() == list(range(len(prompt)))
            seen.append(runner.head(to_logits).float()[:, : runner.vocab_limit])
        return to_logits, to_next

    runner.model.draft_forward = record
    try:
        engine.flush_cache()
        engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 1})
    finally:
        del runner.model.draft_forward
    return seen[0]


def rollouts(engine: Engine) -> tuple[list[list[int]], float]:
    """The policy's greedy continuations of PROMPTS (prompt + response) and the accept length
    (tokens per verify step) the engine's draft got on them."""
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    verify = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    accepted = sum(o["meta_info"]["spec_accept_token_num"] for o in outs)
    return [p + o["output_ids"] for p, o in zip(PROMPTS, outs)], (accepted + verify) / verify


def response_mask(sequences: list[list[int]]) -> torch.Tensor:
    """[b, S - 1]: position t scores token t + 1, a response token."""
    mask = torch.zeros(len(sequences), len(sequences[0]) - 1)
    for row, prompt in zip(mask, PROMPTS):
        row[len(prompt) - 1 :] = 1.0
    return mask


def push(engine: Engine, draft: StandaloneDraft, version: str) -> None:
    pusher = WeightPusher([engine], WeightSyncConfig(check_weight_update_equal=True))
    try:
        pusher.push(((DRAFT_PREFIX + n, t) for n, t in draft.hf_named_tensors()), version)
    finally:
        pusher.close()


def test_draft_logits_equal_the_engines(standalone, engine):
    _, path = standalone
    draft = StandaloneDraft.from_pretrained(path, CPU)
    prompt = PROMPTS[0]
    with torch.no_grad():
        logits = draft(torch.tensor([prompt]))[0]
    assert logits.shape[-1] == 520  # its own padded vocabulary; the engine drafts from 512
    torch.testing.assert_close(
        logits[:, :POLICY_VOCAB], engine_draft_logits(engine, prompt), atol=1e-5, rtol=1e-5
    )
    # The tied head is one tensor, pushed under the embedding's name (the engine ties it too).
    names = [n for n, _ in draft.hf_named_tensors()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert "model.layers.0.self_attn.q_proj.bias" in names
    with torch.no_grad():  # an id past the draft's rows reads its last one, as in the engine
        torch.testing.assert_close(draft(torch.tensor([[3, 600]])), draft(torch.tensor([[3, 519]])))


def test_distillation_raises_the_engines_acceptance(standalone, engine):
    """KL to the policy's logits (transformers' forward of the policy: an oracle independent of
    the trainer) falls under Adam and reaches the draft alone; pushed (checksums checked), the
    engine drafts with it, and its accept length on the policy's own greedy rollouts rises."""
    from transformers import AutoModelForCausalLM

    policy_path, path = standalone
    sequences, before = rollouts(engine)
    tokens = torch.tensor(sequences)
    mask = response_mask(sequences)
    policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
    with torch.no_grad():
        teacher = policy(input_ids=tokens).logits.requires_grad_(True)
    draft = StandaloneDraft.from_pretrained(path, CPU)
    optimizer = torch.optim.Adam(draft.parameters(), lr=1e-2)
    history = []
    for _ in range(25):
        optimizer.zero_grad()
        loss, parts = distill_loss(draft, tokens, teacher, mask)
        loss.backward()
        optimizer.step()
        history.append((loss.item(), parts["top1_agreement"].item()))
    kl, agreement = zip(*history)
    assert kl[-1] < 0.3 * kl[0] and agreement[-1] > agreement[0], history
    assert teacher.grad is None and all(p.grad is not None for p in draft.parameters())

    proposed = engine_draft_logits(engine, PROMPTS[0])
    push(engine, draft, "distilled")
    assert engine.get_server_info()["weight_version"] == "distilled"
    moved = engine_draft_logits(engine, PROMPTS[0])
    with torch.no_grad():
        ours = draft(torch.tensor([PROMPTS[0]]))[0, :, :POLICY_VOCAB]
    torch.testing.assert_close(moved, ours, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(moved, proposed)
    again, after = rollouts(engine)
    assert again == sequences  # the target is untouched: greedy outputs are the same
    assert after > before + 0.5, (before, after)

    original = StandaloneDraft.from_pretrained(path, CPU)  # leave the engine as it was
    push(engine, original, "original")


def test_the_trainer_distills_pushes_and_checkpoints_the_draft(standalone, engine, tmp_path):
    """--enable-draft-training with STANDALONE: train steps on the megatron policy's logits lower
    the draft's KL, a push carries it (checked tensor by tensor), its checkpoint entry (weights
    and Adam state, saved and read as trainer_bridge.checkpoint saves and reads `common.pt`;
    test_eagle2_training.py runs that path whole) resumes it bit for bit, and resumed with
    --draft-lr 0 it stays frozen."""
    pytest.importorskip("megatron.core")
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.drafts.online import OnlineDraft
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    policy, path = standalone
    args = TrainerArgs(
        hf_checkpoint=policy,
        lr=1e-6,
        enable_draft_training=True,
        draft_checkpoint=path,
        speculative_algorithm="STANDALONE",
        draft_lr=1e-2,
    )
    actor = TrainActor(args)
    try:
        online = actor.online_draft
        assert isinstance(online.draft, StandaloneDraft) and online.capture is None
        tokens = [PROMPTS[0] + [7 + i, 9, 11, 13, 15, 17] for i in range(4)]
        batch = TrainBatch(tokens, [6] * 4, [1.0, 0.0, 1.0, 0.0], n_samples_per_prompt=4)
        rows = [actor.train(batch) for _ in range(2)]
        losses = [r["train/draft_loss"] for r in rows]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0], losses
        assert 0.0 <= rows[1]["train/draft_loss/top1_agreement"] <= 1.0

        actor.push_weights([engine], WeightSyncConfig(check_weight_update_equal=True), "v2")
        assert engine.get_server_info()["weight_version"] == "v2"
        trained = online.draft.lm.model.layers[0].self_attn.q_proj.bias
        engine_model = engine.scheduler.worker.draft.model
        assert torch.equal(engine_model.model.layers[0].self_attn.qkv_proj.bias[:32], trained)
        fresh = StandaloneDraft.from_pretrained(path, CPU)
        assert not torch.equal(trained, fresh.lm.model.layers[0].self_attn.q_proj.bias)

        tokens_t = torch.tensor(tokens)
        mask = torch.zeros(4, tokens_t.shape[1] - 1)
        mask[:, -6:] = 1.0

        def draft_step(draft: OnlineDraft) -> dict[str, torch.Tensor]:
            with torch.no_grad():
                logits, _ = actor._forward(PaddedMicroBatch(tokens_t))
            draft.backward(tokens_t, logits, mask, 1.0)
            draft.step()
            return {n: t.clone() for n, t in draft.draft.state_dict().items()}

        ckpt = str(tmp_path / "draft.pt")
        torch.save(online.state_dict(), ckpt)
        saved = {n: t.clone() for n, t in online.draft.state_dict().items()}
        expected = draft_step(online)
        assert any(not torch.equal(expected[n], t) for n, t in saved.items())
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        online.load_state_dict(state)
        got = draft_step(online)
        assert all(torch.equal(got[n], t) for n, t in expected.items())

        # Resumed with --draft-lr 0: the saved draft and Adam state, and no step moves it.
        frozen = OnlineDraft(
            dataclasses.replace(args, draft_lr=0.0), actor.gpt, actor.arch, actor.device
        )
        frozen.load_state_dict(state)
        after = draft_step(frozen)
        assert all(torch.equal(after[n], t) for n, t in saved.items())
    finally:
        destroy_model_parallel()
        push(engine, StandaloneDraft.from_pretrained(path, CPU), "original")


def test_what_cannot_distill_is_refused(standalone, tmp_path):
    from spec_engine.models.hf_config import ModelConfig
    from specrl.train_options import parse_args
    from trainer_bridge.drafts.online import load_draft

    argv = ["--hf-checkpoint", "m", "--prompt-data", "d", "--rollout-batch-size", "1"]
    argv += ["--num-rollout", "1", "--output-dir", "o", "--enable-draft-training"]
    argv += ["--sglang-speculative-algorithm", "STANDALONE"]
    # Taken, and the trainer learns which draft it trains from the algorithm.
    trainer = parse_args([*argv, "--sglang-speculative-draft-model-path", "d"]).options.trainer
    assert (trainer.speculative_algorithm, trainer.draft_checkpoint) == ("STANDALONE", "d")
    for extra, needle in (
        ([], "it needs the draft LM"),
        (["--sglang-speculative-draft-model-path", "m"], "the draft is --hf-checkpoint itself"),
    ):
        with pytest.raises(SystemExit, match=needle):
            parse_args([*argv, *extra])

    policy, path = standalone
    with pytest.raises(ValueError, match="EAGLE3 trains a LlamaForCausalLMEagle3 draft"):
        load_draft(path, CPU, "EAGLE3")  # a plain LM is STANDALONE's
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    config = json.loads((Path(path) / "config.json").read_text())
    (eagle / "config.json").write_text(json.dumps({**config, "architectures": [EAGLE2]}))
    with pytest.raises(ValueError, match=f"is a {EAGLE2} draft .* EAGLE or EAGLE3 for it"):
        load_draft(str(eagle), CPU, "STANDALONE")
    # Another vocab_size with no tokenizer to show it is the policy's: refused, naming both.
    lone = str(tmp_path / "lone")
    os.makedirs(lone)
    shutil.copy(os.path.join(path, "config.json"), lone)
    configs = ModelConfig.from_pretrained(lone), ModelConfig.from_pretrained(policy)
    with pytest.raises(ValueError, match="the draft's vocab_size is 520 .* the target's 512"):
        check_vocabulary(*configs, lone, policy)
    check_vocabulary(*configs, path, policy)  # the same tokenizer, padded otherwise
