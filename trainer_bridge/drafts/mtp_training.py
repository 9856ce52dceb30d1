"""How the draft (the model's MTP layers) trains online: which of its layers learn, and
--draft-lr, their own learning rate.

Adam's update (decoupled weight decay included) is linear in the learning rate, and its moments
do not depend on it: scaling the MTP layers' update by draft_lr / lr after a step is that step
at draft_lr. Done this way, the optimizer keeps one parameter group, so the checkpoint layout
and the clipping norm are those of a run without the flag.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn


def set_trainable(model: nn.Module, num_mtp_layers: int, enable_mtp_training: bool) -> None:
    """Freeze the MTP block without --enable-mtp-training (a frozen draft is pushed unchanged
    every step); with it, only the first MTP layer drafts and gets a loss, so the others are
    frozen rather than left to decay under weight decay."""
    if num_mtp_layers and not enable_mtp_training:
        model.mtp.requires_grad_(False)
    elif num_mtp_layers > 1:
        for layer in model.mtp.layers[1:]:
            layer.requires_grad_(False)


class DraftLearningRate:
    def __init__(self, model: nn.Module, lr: float, draft_lr: Optional[float]) -> None:
        """`model`: the GPT model (its `mtp` block, if any, is the draft); a no-op when
        draft_lr is None or lr."""
        self.scale = None
        self.params: list[nn.Parameter] = []
        draft = getattr(model, "mtp", None)
        if draft is not None and draft_lr is not None and draft_lr != lr:
            self.scale = draft_lr / lr
            self.params = [p for p in draft.parameters() if p.requires_grad]

    @contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one optimizer step."""
        before = [p.detach().clone() for p in self.params]
        yield
        with torch.no_grad():
            for p, p0 in zip(self.params, before):
                p.copy_(p0 + (p - p0) * self.scale)
