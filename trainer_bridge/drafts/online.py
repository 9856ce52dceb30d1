"""--enable-draft-training: the engines' external draft (EAGLE-2, EAGLE-3 or STANDALONE) trained
online beside the policy.

The draft learns from the policy's own forward in each train step: forward hooks on the megatron
model keep (detached) the hidden states the engine's draft reads, the policy's logits are the
teacher, and the draft's loss backpropagates into the draft alone, once per micro batch. What
differs by draft is a `_Kind`, picked by the algorithm and the checkpoint's architecture: EAGLE-3
(trainer_bridge.drafts.eagle3) reads the captured auxiliary layers and learns by SpecForge's
training-time-test loss; EAGLE-2 (trainer_bridge.drafts.eagle2) reads the final hidden state and
learns by EAGLE's feature regression + cross-entropy through the policy's head, which it drafts
with (neither trained nor pushed as the draft's); a STANDALONE draft
(trainer_bridge.drafts.standalone: a plain LM, which the algorithm names rather than its
architecture) reads only the tokens and is distilled from the policy's logits, KL(policy ||
draft). The draft steps with its own Adam after each policy step, so the policy's optimizer,
clipping and checkpoint layout are those of a run without it. Its weights travel with the policy's
in every push, under the engine's `draft.` prefix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.registry import model_class
from spec_engine.weights.updater import DRAFT_PREFIX
from trainer_bridge.drafts.eagle2 import EAGLE2_ARCHITECTURE, Eagle2Draft, eagle_loss
from trainer_bridge.drafts.eagle3 import EAGLE3_ARCHITECTURE, Eagle3Draft, ttt_loss
from trainer_bridge.drafts.standalone import (
    STANDALONE,
    StandaloneDraft,
    check_vocabulary,
    distill_loss,
)
from trainer_bridge.options import TrainerArgs


class FeatureCapture:
    """The outputs of `modules` (label, module) in the policy's latest forward, concatenated in
    that order (a module may repeat): the residual stream entering decoder layer i is the output
    of layer i - 1 (of the embedding for i = 0), as the engine's EAGLE-3 target captures it
    (LlamaModel's capture_layers); the decoder's output is the final normed hidden state, the
    engine's `ForwardOutput.hidden` that EAGLE-2 reads."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]]) -> None:
        self.labels = [label for label, _ in modules]
        self._states: dict[str, Tensor] = {}
        self._handles = []
        for label, module in dict(modules).items():
            self._handles.append(module.register_forward_hook(self._keep(label)))

    def _keep(self, label: str):
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            state = output[0] if isinstance(output, tuple) else output
            self._states[label] = state.detach()

        return hook

    def features(self) -> Tensor:
        """[b, s, n x H] from the latest forward (megatron's states are [s, b, H])."""
        missing = [label for label in self.labels if label not in self._states]
        if missing:
            raise RuntimeError(f"no policy forward captured {missing}")
        return torch.cat([self._states[x] for x in self.labels], dim=-1).transpose(0, 1).float()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _layer_input(gpt: nn.Module, i: int) -> tuple[str, nn.Module]:
    # Layer i's input is layer i - 1's output; layer 0's is the embedding's.
    return f"the input of layer {i}", gpt.embedding if i == 0 else gpt.decoder.layers[i - 1]


class _Eagle3:
    """EAGLE-3: the layers the engine captures; SpecForge's training-time-test loss."""

    def __init__(self, draft: Eagle3Draft, gpt: nn.Module, arch: ModelConfig) -> None:
        self.draft = draft
        layers = model_class(arch).eagle3_capture_layers(arch, draft.config.eagle_aux_layer_ids)
        # In layer order, as the engine concatenates them (a tiny model's clamped default,
        # (2, 2, 1), is not sorted).
        self.capture = FeatureCapture([_layer_input(gpt, i) for i in sorted(layers)])
        self.embedding = gpt.embedding.word_embeddings.weight

    def loss(self, tokens: Tensor, logits: Tensor, mask: Tensor) -> tuple[Tensor, dict]:
        features = self.capture.features()
        total, per_step = ttt_loss(self.draft, self.embedding, tokens, features, logits, mask)
        return total, {f"step_{k}": loss for k, loss in enumerate(per_step)}


class _Eagle2:
    """EAGLE-2: the final hidden state; EAGLE's loss through the policy's own head."""

    def __init__(self, draft: Eagle2Draft, gpt: nn.Module, arch: ModelConfig) -> None:
        self.draft = draft
        self.capture = FeatureCapture([("the decoder's output", gpt.decoder)])
        self.embedding = gpt.embedding.word_embeddings.weight
        self.vocab_size = arch.vocab_size
        self.head = (
            gpt.shared_embedding_or_output_weight()
            if gpt.share_embeddings_and_output_weights
            else gpt.output_layer.weight
        )

    def loss(self, tokens: Tensor, logits: Tensor, mask: Tensor) -> tuple[Tensor, dict]:
        head = self.head[: self.vocab_size]  # megatron pads the vocabulary
        features = self.capture.features()
        return eagle_loss(self.draft, self.embedding, head, tokens, features, logits, mask)


class _Standalone:
    """STANDALONE: a plain LM over the tokens alone; distilled from the policy's logits."""

    capture = None  # nothing of the policy's forward but its logits

    def __init__(self, draft: StandaloneDraft, gpt: nn.Module, arch: ModelConfig) -> None:
        self.draft = draft

    def loss(self, tokens: Tensor, logits: Tensor, mask: Tensor) -> tuple[Tensor, dict]:
        return distill_loss(self.draft, tokens, logits, mask)


_KINDS = {
    EAGLE3_ARCHITECTURE: (Eagle3Draft, _Eagle3),
    EAGLE2_ARCHITECTURE: (Eagle2Draft, _Eagle2),
}
# What each --sglang-speculative-algorithm drafts with (NEXTN is SGLang's alias of EAGLE).
_ALGORITHMS = {
    "EAGLE": EAGLE2_ARCHITECTURE,
    "NEXTN": EAGLE2_ARCHITECTURE,
    "EAGLE3": EAGLE3_ARCHITECTURE,
}


def load_draft(
    path: Optional[str],
    device: torch.device,
    algorithm: Optional[str] = None,
    positions: int = 0,
) -> Eagle2Draft | Eagle3Draft | StandaloneDraft:
    """The draft at `path` (--sglang-speculative-draft-model-path) for the engines'
    `algorithm` (None: the checkpoint's architecture decides, a plain LM being STANDALONE's); an
    EAGLE draft's rotary tables cover at least `positions` (the policy's)."""
    if path is None or not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"--enable-draft-training needs the draft checkpoint the engines load "
            f"(--sglang-speculative-draft-model-path); got {path!r}"
        )
    with open(os.path.join(path, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    algorithm = algorithm.upper() if algorithm is not None else None
    eagle = [arch for arch in archs if arch in _KINDS]
    if algorithm == STANDALONE or (algorithm is None and archs and not eagle):
        return StandaloneDraft.from_pretrained(path, device)
    expected = _ALGORITHMS.get(algorithm) if algorithm is not None else None
    for arch in eagle:
        if expected in (None, arch):
            return _KINDS[arch][0].from_pretrained(path, device, positions)
    wanted = expected or " or ".join(sorted(_KINDS))
    given = f" with --sglang-speculative-algorithm {algorithm}" if algorithm else ""
    raise ValueError(
        f"--enable-draft-training{given} trains a {wanted} draft; {path} is {archs or 'unknown'}"
    )


class OnlineDraft:
    """The draft, its optimizer and the hooks feeding it."""

    def __init__(
        self,
        args: TrainerArgs,
        gpt: nn.Module,
        arch: ModelConfig,
        device: torch.device,
    ) -> None:
        self.draft = load_draft(
            args.draft_checkpoint, device, args.speculative_algorithm, arch.max_position_embeddings
        )
        config = self.draft.config
        if isinstance(self.draft, StandaloneDraft):
            # Its own vocabulary, which may be padded otherwise (the same tokenizer's).
            check_vocabulary(config, arch, args.draft_checkpoint, args.hf_checkpoint)
        elif config.vocab_size != arch.vocab_size:
            raise ValueError(
                f"the draft {args.draft_checkpoint} maps into a vocabulary of "
                f"{config.vocab_size} tokens, the policy has {arch.vocab_size}"
            )
        if config.hidden_size != arch.hidden_size and isinstance(self.draft, Eagle2Draft):
            raise ValueError(
                f"the EAGLE-2 draft {args.draft_checkpoint} has hidden size "
                f"{config.hidden_size}, the policy {arch.hidden_size}: it reads the policy's "
                "features and drafts with its head"
            )
        if isinstance(self.draft, StandaloneDraft):
            self.kind = _Standalone(self.draft, gpt, arch)
        else:
            self.kind = _KINDS[config.architecture][1](self.draft, gpt, arch)
        self.capture = self.kind.capture
        # Decoupled weight decay, as megatron's Adam steps the policy (and SpecForge its drafts).
        self.optimizer = torch.optim.AdamW(
            self.draft.parameters(),
            lr=args.draft_lr if args.draft_lr is not None else args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            weight_decay=args.weight_decay,
        )
        self.clip_grad = args.clip_grad
        self._losses: dict[str, float] = {}

    @classmethod
    def build(
        cls,
        args: TrainerArgs,
        gpt: nn.Module,
        arch: ModelConfig,
        device: torch.device,
        world_size: int,
    ) -> OnlineDraft | NoOnlineDraft:
        """The online draft with --enable-draft-training, else a stand-in that does nothing."""
        if not args.enable_draft_training:
            return NoOnlineDraft()
        if world_size != 1:
            raise ValueError(
                f"--enable-draft-training runs on one trainer rank for now, got {world_size}: "
                "the draft is not sharded or all-reduced across ranks; train with one rank "
                "(--actor-num-gpus-per-node 1) or drop the flag"
            )
        return cls(args, gpt, arch, device)

    def backward(self, tokens: Tensor, logits: Tensor, mask: Tensor, weight: float) -> None:
        """The draft's loss on the micro batch the policy just ran forward (`logits` [b, s, V]
        its logits, `mask` [b, s - 1] its scored positions), scaled by `weight` (the micro batch's
        share of the step) and backpropagated into the draft."""
        total, parts = self.kind.loss(tokens, logits, mask)
        (total * weight).backward()
        names = ["draft_loss", *(f"draft_loss/{name}" for name in parts)]
        values = torch.stack([total.detach(), *parts.values()]).tolist()  # one device sync
        for name, value in zip(names, values):
            self._losses[name] = self._losses.get(name, 0.0) + value * weight

    def step(self) -> dict[str, float]:
        """One Adam step on the accumulated gradients (clipped at --clip-grad, as the policy's);
        returns the step's draft_loss and its parts (EAGLE-3: each training-time-test step's
        loss, draft_loss/step_k; EAGLE-2: draft_loss/feature and draft_loss/token; STANDALONE:
        draft_loss/top1_agreement, the share of response positions where the draft's argmax is
        the policy's)."""
        if self.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics, self._losses = self._losses, {}
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The draft and its Adam state, for the training checkpoint (trainer_bridge.checkpoint)."""
        return {"model": self.draft.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, own = sorted(state["model"]), sorted(self.draft.state_dict())
        if saved != own:
            raise ValueError(
                "the checkpoint's online draft is not the one --sglang-speculative-draft-model-"
                f"path gives (tensors {saved[:4]}..., this draft's {own[:4]}...); resume with "
                "the draft the run trained"
            )
        self.draft.load_state_dict(state["model"])
        # torch restores the saved learning rate with the moments; the resumed run's --draft-lr
        # (or --lr) must hold instead (a frozen --draft-lr 0 resumed from a trained draft).
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr

    def with_draft(self, policy: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """The policy's tensors, then what the engines take for their external draft: its
        parameters (and EAGLE-3's id map; a STANDALONE draft's tied head once), named
        `draft.<checkpoint name>` (t2d is left out: the engine, like SGLang, does not read it)."""
        yield from policy
        for name, tensor in self.draft.hf_named_tensors():
            if name != "t2d":
                yield DRAFT_PREFIX + name, tensor.detach()


class NoOnlineDraft:
    """Without --enable-draft-training: no draft loss, no draft step, the policy's tensors alone."""

    def backward(self, tokens: Tensor, logits: Tensor, mask: Tensor, weight: float) -> None:
        pass

    def step(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def with_draft(self, policy: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        return policy
