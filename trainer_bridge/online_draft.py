"""--enable-draft-training: the engines' external EAGLE-3 draft trained online beside the policy.

The draft learns from the policy's own forward in each train step: forward hooks on the megatron
decoder keep (detached) the hidden states the engine's EAGLE-3 draft reads, the policy's logits are
the teacher, and the draft's training-time-test loss (trainer_bridge.eagle3_draft) backpropagates
into the draft alone, once per micro batch. The draft steps with its own Adam after each policy
step, so the policy's optimizer, clipping and checkpoint layout are those of a run without it.
Its weights travel with the policy's in every push, under the engine's `draft.` prefix.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.registry import model_class
from spec_engine.weights.updater import DRAFT_PREFIX
from trainer_bridge.eagle3_draft import TTT_LENGTH, load_draft, ttt_loss
from trainer_bridge.options import TrainerArgs


class FeatureCapture:
    """The residual stream entering each of `layers` (len(decoder layers): the last layer's
    output, before the final norm) in the policy's latest forward, as the engine's EAGLE-3 target
    captures it (LlamaModel's capture_layers)."""

    def __init__(self, gpt: nn.Module, layers: tuple[int, ...]) -> None:
        # In layer order, as the engine concatenates them (a tiny model's clamped default,
        # (2, 2, 1), is not sorted).
        self.layers = tuple(sorted(layers))
        self._states: dict[int, Tensor] = {}
        self._handles = []
        for i in sorted(set(layers)):
            # Layer i's input is layer i - 1's output; layer 0's is the embedding's.
            module = gpt.embedding if i == 0 else gpt.decoder.layers[i - 1]
            self._handles.append(module.register_forward_hook(self._keep(i)))

    def _keep(self, index: int):
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            state = output[0] if isinstance(output, tuple) else output
            self._states[index] = state.detach()

        return hook

    def features(self) -> Tensor:
        """[b, s, len(layers) x H] from the latest forward (megatron's states are [s, b, H])."""
        missing = [i for i in self.layers if i not in self._states]
        if missing:
            raise RuntimeError(f"no policy forward captured the hidden states entering {missing}")
        return torch.cat([self._states[i] for i in self.layers], dim=-1).transpose(0, 1).float()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class OnlineDraft:
    """The draft, its optimizer and the hooks feeding it."""

    def __init__(
        self,
        args: TrainerArgs,
        gpt: nn.Module,
        arch: ModelConfig,
        device: torch.device,
    ) -> None:
        self.draft = load_draft(args.draft_checkpoint, device)
        config = self.draft.config
        if config.vocab_size != arch.vocab_size:
            raise ValueError(
                f"the EAGLE-3 draft {args.draft_checkpoint} maps into a vocabulary of "
                f"{config.vocab_size} tokens, the policy has {arch.vocab_size}"
            )
        layers = model_class(arch).eagle3_capture_layers(arch, config.eagle_aux_layer_ids)
        self.capture = FeatureCapture(gpt, layers)
        self.embedding = gpt.embedding.word_embeddings.weight
        # Decoupled weight decay, as megatron's Adam steps the policy (and SpecForge its drafts).
        self.optimizer = torch.optim.AdamW(
            self.draft.parameters(),
            lr=args.draft_lr if args.draft_lr is not None else args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            weight_decay=args.weight_decay,
        )
        self.clip_grad = args.clip_grad
        self._losses = [0.0] * TTT_LENGTH
        self._total = 0.0

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
        total, per_step = ttt_loss(
            self.draft,
            self.embedding,
            tokens,
            self.capture.features(),
            logits,
            mask,
        )
        (total * weight).backward()
        values = torch.stack([total.detach(), *per_step]).tolist()  # one device sync
        self._total += values[0] * weight
        for k, loss in enumerate(values[1:]):
            self._losses[k] += loss * weight

    def step(self) -> dict[str, float]:
        """One Adam step on the accumulated gradients (clipped at --clip-grad, as the policy's);
        returns the step's draft_loss (the weighted sum) and each training-time-test step's
        loss."""
        if self.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {"draft_loss": self._total}
        metrics.update((f"draft_loss/step_{k}", v) for k, v in enumerate(self._losses))
        self._losses = [0.0] * TTT_LENGTH
        self._total = 0.0
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The draft and its Adam state, for the training checkpoint (trainer_bridge.checkpoint)."""
        return {"model": self.draft.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draft.load_state_dict(state["model"])
        # torch restores the saved learning rate with the moments; the resumed run's --draft-lr
        # (or --lr) must hold instead (a frozen --draft-lr 0 resumed from a trained draft).
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr

    def with_draft(self, policy: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """The policy's tensors, then what the engines take for their external draft: its
        parameters and id map, named `draft.<checkpoint name>` (t2d is left out: the engine, like
        SGLang, does not read it)."""
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
