"""A STANDALONE draft (an ordinary small causal LM sharing the policy's tokenizer) on the trainer
side, and its online distillation loss: forward KL(policy || draft) at response positions.

The draft is the checkpoint at --sglang-speculative-draft-model-path loaded by transformers
(AutoModelForCausalLM, float32, on the trainer's device), so its parameter names are the
checkpoint's own Hugging Face names, which the engine's STANDALONE draft takes under the `draft.`
prefix (spec_engine.weights.updater). A tied head is one parameter here (transformers keeps it as
`model.embed_tokens.weight`), pushed once under that name: the engine ties it too. transformers
may rename what it converts on load (fused MoE experts): every name pushed must be one of the
checkpoint's, else the draft is refused.

The engine drafts with softmax(head(h)) over the ids both vocabularies have: a draft padded past
the policy's vocabulary never proposes the extra ids (DraftRunner.vocab_limit), a draft padded
less reads the policy's padding ids (outside the shared tokenizer) as its last row. The loss
compares the two distributions over those shared ids, each renormalised there: sum_v p(v) (log
p(v) - log q(v)) with p = softmax(policy logits), q = softmax(draft logits), temperature 1, at
each position t whose next token t + 1 is a response token (the policy's loss mask), averaged
over them. The teacher is the policy's logits from the same micro batch, detached.

Layout as trainer_bridge.drafts.eagle3's: tokens [b, S]; `target_logits` [b, S, V], position t
predicting token t + 1; `mask` [b, S - 1], t marking token t + 1 as a response token.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from spec_engine.args.resolve import check_same_tokenizer
from spec_engine.models.hf_config import ModelConfig
from spec_engine.weights.loader import checkpoint_metadata, is_ignored

STANDALONE = "STANDALONE"


class StandaloneDraft(nn.Module):
    """The draft LM (`lm`, a transformers causal LM) and its checkpoint config; see the module
    docstring."""

    def __init__(self, lm: nn.Module, config: ModelConfig, path: str) -> None:
        super().__init__()
        self.lm = lm
        self.config = config
        names = {name for name, _, _ in checkpoint_metadata(path) if not is_ignored(name)}
        renamed = sorted(n for n, _ in self.hf_named_tensors() if n not in names)
        if renamed:
            raise ValueError(
                f"the STANDALONE draft {path} ({config.architecture}) loads into transformers "
                f"under names its checkpoint lacks ({renamed[:3]}...), which the engines could "
                "not take in a weight push; use a dense Llama/Qwen2/Qwen3 draft or keep it "
                "frozen (drop --enable-draft-training)"
            )

    @classmethod
    def from_pretrained(cls, path: str, device: torch.device) -> StandaloneDraft:
        """The draft in `path`, float32 (its optimizer steps these weights directly), in eval
        mode (no dropout: a train step is a deterministic function of the batch)."""
        from transformers import AutoModelForCausalLM

        config = ModelConfig.from_pretrained(path)
        if config.is_draft:
            raise ValueError(
                f"a STANDALONE draft is a plain causal LM; {path} is a {config.architecture} "
                "draft (use --sglang-speculative-algorithm EAGLE or EAGLE3 for it)"
            )
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return cls(lm.to(device).eval(), config, path)

    @property
    def vocab_size(self) -> int:
        return self.lm.get_output_embeddings().weight.shape[0]

    def hidden(self, tokens: Tensor) -> Tensor:
        """The final normed hidden states [b, s, H] over `tokens` [b, s] (causal, positions
        0..s-1, as the engine's draft runs a sequence). A policy id past the draft's embedding
        rows (a padding id outside the shared tokenizer) reads its last row, as in the engine
        (DraftRunner.embed_limit)."""
        rows = self.lm.get_input_embeddings().num_embeddings
        ids = tokens.clamp(max=rows - 1)
        return self.lm.base_model(input_ids=ids, use_cache=False).last_hidden_state

    def head(self, hidden: Tensor) -> Tensor:
        return self.lm.get_output_embeddings()(hidden).float()

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits [b, s, V_draft] over `tokens` [b, s]."""
        return self.head(self.hidden(tokens))

    def hf_named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter under its checkpoint name, a tied one once (without the engine's
        `draft.` prefix)."""
        yield from self.lm.named_parameters()


def check_vocabulary(
    draft: ModelConfig, policy: ModelConfig, draft_path: str, policy_path: str
) -> None:
    """A draft with another vocab_size than the policy's must pad one tokenizer differently
    (the engine's own check, spec_engine.args.resolve): refused naming both sizes otherwise."""
    if draft.vocab_size == policy.vocab_size:
        return
    try:
        check_same_tokenizer(policy_path, draft_path, policy, draft)
    except ValueError as e:
        raise ValueError(
            f"--enable-draft-training distills the policy into the draft; {e}"
        ) from None


def distill_loss(
    draft: StandaloneDraft, tokens: Tensor, target_logits: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL(policy || draft) averaged over response positions (see the module docstring), and its
    one part, the draft's top-1 agreement with the policy there (what a greedy chain accepts)."""
    rows = mask > 0
    weights = mask[rows].float()
    count = weights.sum().clamp(min=1.0)
    hidden = draft.hidden(tokens[:, :-1])[rows]  # [N, H]: the scored positions only
    shared = min(draft.vocab_size, target_logits.shape[-1])
    student = torch.log_softmax(draft.head(hidden)[:, :shared], -1)
    with torch.no_grad():
        teacher = torch.log_softmax(target_logits[:, :-1][rows][:, :shared].float(), -1)
        agree = ((student.argmax(-1) == teacher.argmax(-1)).float() * weights).sum() / count
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    return (kl * weights).sum() / count, {"top1_agreement": agree}
