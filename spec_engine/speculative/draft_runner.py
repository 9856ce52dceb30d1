"""DraftRunner: a draft model with its own KV pool, indexed by the target's slots.

The draft shares the target's slot allocator and request-to-token table: slot s holds the
target's K/V in the target pool and the draft's in this one. Embedding and LM head come from
the draft when it has its own (STANDALONE; an EAGLE-3 draft vocabulary), else from the target.
Draft ids map to target ids through `hot_ids` (EAGLE-3's d2t, or an FR-Spec token map).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from spec_engine.args.resolve import DraftKind, EngineConfig
from spec_engine.distributed.parallel_state import use_tp_group
from spec_engine.forward_batch import ForwardBatch, ForwardMode
from spec_engine.layers.linear import Linear
from spec_engine.mem.kv_pool import KVPool
from spec_engine.models.registry import model_class, mtp_class
from spec_engine.runner.base import RunnerBase
from spec_engine.runner.graph_runner import GraphSpec
from spec_engine.runner.model_runner import ModelRunner, new_kv_pool, rank_config
from spec_engine.weights.loader import build_model


class DraftRunner(RunnerBase):
    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        self.kind = config.draft_kind
        self.target = target
        # The target drafting for itself runs its own model on its own KV cache: the draft's KV
        # at a position would equal the target's there.
        self.shares_target = config.self_draft
        # --enable-multi-layer-eagle: draft step k runs MTP layer k (its own layer of the pool).
        args = config.args
        self.mtp_layers = args.speculative_num_steps if args.enable_multi_layer_eagle else 1
        self.model = self._build_model(config)  # before RunnerBase sets it: refresh() reads it
        self._bind_vocab(config)
        self.refresh()
        super().__init__(
            args,
            config.draft,
            self.model,
            self._kv_pool(config),
            target.req_to_token_pool,
            target.allocator,
            target.max_running_requests,
            target.graph_pool,
            self._graph_specs(config),
        )

    def _build_model(self, config: EngineConfig) -> nn.Module:
        """The draft model: the target itself for a self-draft, else built from its checkpoint
        (an MTP draft: only the MTP layers' weights of the target's)."""
        if self.shares_target:
            return self.target.model
        kind, draft = self.kind, config.draft
        cls = mtp_class(draft) if kind is DraftKind.MTP else model_class(draft)
        # At the target's TP (SGLang's draft workers share its group): the draft's layers are
        # split as the target's, over the same ranks.
        with use_tp_group(self.target.tp):
            return build_model(
                cls,
                draft,
                self.target.dtype,
                self.target.device,
                config.draft_checkpoint,
                only_known=kind is DraftKind.MTP,
                **({"num_layers": self.mtp_layers} if self.mtp_layers > 1 else {}),
            )

    def _bind_vocab(self, config: EngineConfig) -> None:
        """Embedding and head (the draft's own where it has them, else the target's), the
        vocabulary limits between a STANDALONE draft and its target, and an FR-Spec token map."""
        kind, draft, target = self.kind, config.draft, self.target
        if kind is DraftKind.STANDALONE:
            self.embed, self.head = self.model.model.embed_tokens, self.model.lm_head
        else:
            self.embed = target.model.model.embed_tokens
            own = self.model.draft_head() if kind is DraftKind.EAGLE3 else None
            self.head = own if own is not None else target.model.lm_head
        # A STANDALONE draft with another vocab_size than the target (padded embedding rows;
        # resolve checked that the tokenizers agree) never proposes ids the target lacks, and
        # reads a target id past its own rows (a padding id, outside the tokenizer) as its last.
        standalone = kind is DraftKind.STANDALONE
        target_vocab = config.target.vocab_size
        self.vocab_limit = target_vocab if standalone and draft.vocab_size > target_vocab else None
        self.embed_limit = (
            draft.vocab_size if standalone and draft.vocab_size < target_vocab else None
        )
        self.token_map = None
        token_map = config.args.speculative_token_map
        if token_map is not None:
            self.token_map = load_token_map(token_map, draft.vocab_size).to(target.device)

    def _kv_pool(self, config: EngineConfig) -> KVPool:
        """The target's pool for a self-draft, else a pool of the draft's layers (an MTP draft's
        are layers of the target's shape; every other draft is all of its config)."""
        if self.shares_target:
            return self.target.kv_pool
        draft, target = config.draft, self.target
        layers = self.mtp_layers if self.kind is DraftKind.MTP else draft.num_hidden_layers
        return new_kv_pool(
            rank_config(draft, target.tp),  # this rank's KV heads of the draft
            target.max_total_tokens,
            config.args.page_size,
            layers,
            target.dtype,
            target.device,
        )

    @property
    def external(self) -> bool:
        """Weights of its own checkpoint, updated as `draft.*` (an MTP draft's are the target's,
        and a self-draft's are the target itself)."""
        return self.kind.external and not self.shares_target

    def _graph_specs(self, config: EngineConfig) -> list[GraphSpec]:
        """Draft tree steps (topk rows per request, own KV indices), the STANDALONE root step,
        and the draft extend over a round's accepted tokens (up to steps + 1 per request)."""
        args = config.args
        # Multi-layer MTP extends read every row's features (the next layer's input), which
        # the captured draft graphs do not return: its draft runs eagerly.
        if args.disable_cuda_graph or args.disable_draft_cuda_graph or self.mtp_layers > 1:
            return []
        features = self.kind.uses_target_features
        own = config.draft.hidden_size if features else None
        width = 3 if self.kind is DraftKind.EAGLE3 else 1
        target = config.target.hidden_size * width if features else None
        # A tree step's row attends to its prefix, its path (steps - 1 nodes) and itself.
        specs = [
            GraphSpec(
                "draft steps",
                ForwardMode.DECODE,
                args.speculative_eagle_topk,
                own,
                kv_rows=True,
                extra_keys=args.speculative_num_steps,
            ),
        ]
        if not self.shares_target:  # a self-draft has no extend: the target wrote that KV
            extend = GraphSpec(
                "draft extend", ForwardMode.DRAFT_EXTEND, args.speculative_num_steps + 1, target
            )
            specs.append(extend)
        if not features:
            specs.append(GraphSpec("draft root", ForwardMode.DECODE, 1))
        return specs

    def refresh(self) -> None:
        """Rebuild what derives from weights outside the draft model: the id map (EAGLE-3's d2t)
        and the FR-Spec head (hot rows of the target head). Call after any weight change."""
        self.hot_ids = (
            self.token_map
            if self.token_map is not None
            else (self.model.hot_token_ids() if self.kind is DraftKind.EAGLE3 else None)
        )
        if self.hot_ids is not None and self.hot_ids.unique().numel() != self.hot_ids.numel():
            # Two draft ids for one target token would make sibling drafts repeat a token.
            raise ValueError(
                "the draft vocabulary maps two ids to one target token (a repeated id in "
                "--speculative-token-map, or in the EAGLE-3 draft's d2t); ids must be unique"
            )
        if self.token_map is not None:
            rows = self.target.model.lm_head.weight.detach()[self.hot_ids]
            if not isinstance(self.head, Linear) or self.head is self.target.model.lm_head:
                self.head = Linear(
                    self.model.config.hidden_size,
                    len(self.hot_ids),
                    device=rows.device,
                    dtype=rows.dtype,
                )
            # In place: captured draft graphs read this tensor.
            self.head.weight.data.copy_(rows)
            self.head.refresh_derived()

    def check_update(self, tensors: dict[str, torch.Tensor]) -> None:
        """Refuse, before anything is copied, a new EAGLE-3 id map that refresh() could not use."""
        d2t = tensors.get("d2t")
        if d2t is None:
            return
        if d2t.dtype in (torch.bool,) or d2t.is_floating_point() or d2t.is_complex():
            raise ValueError(f"weight 'draft.d2t' must be an integer tensor, got {d2t.dtype}")
        vocab = self.target.model_config.vocab_size
        ids = d2t.long() + torch.arange(d2t.numel(), device=d2t.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(
                f"weight 'draft.d2t' maps draft ids outside the target vocabulary [0, {vocab})"
            )
        if ids.unique().numel() != ids.numel():
            raise ValueError(
                "weight 'draft.d2t' maps two draft ids to one target token; ids must be unique"
            )

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        hidden: Optional[torch.Tensor],
        layer: int = 0,
        head_rows: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (draft-vocabulary logits at batch.logits_indices (all rows if None), the
        features for the next draft step at the same rows). `layer`: the MTP layer to run and
        `head_rows`: where batch.logits_indices is None, the only rows to compute logits at
        (multi-layer MTP, which has no draft graphs, reads every row's features)."""
        if layer or head_rows is not None:
            return self._forward(batch, hidden, layer=layer, head_rows=head_rows)
        outs = self._replay(batch, hidden)
        return self._forward(batch, hidden) if outs is None else (outs[0], outs[1])

    def _forward(
        self,
        batch: ForwardBatch,
        hidden: Optional[torch.Tensor] = None,
        metadata: bool = True,
        layer: int = 0,
        head_rows: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._prepare(batch, metadata)
        ids = batch.input_ids
        embeds = self.embed(
            ids if self.embed_limit is None else ids.clamp(max=self.embed_limit - 1)
        )
        extra = {"layer": layer} if layer else {}
        to_logits, to_next = self.model.draft_forward(
            embeds, batch.positions, batch, hidden, **extra
        )
        if batch.logits_indices is not None:
            to_logits, to_next = to_logits[batch.logits_indices], to_next[batch.logits_indices]
        elif head_rows is not None:
            to_logits = to_logits[head_rows]
        logits = self.head(to_logits).float()
        if self.vocab_limit is not None:
            logits = logits[:, : self.vocab_limit]
        return logits, to_next

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.hot_ids is None else self.hot_ids[ids]


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """FR-Spec's hot token ids from a .pt file, or from the one .pt file in a directory (a
    downloaded FR-Spec repository)."""
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.endswith(".pt"))
        if len(found) != 1:
            raise ValueError(
                f"--speculative-token-map {path!r} is a directory with {len(found)} .pt files "
                f"({', '.join(found) or 'none'}); give the path of the one to use"
            )
        path = os.path.join(path, found[0])
    try:
        ids = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as e:
        raise ValueError(
            f"--speculative-token-map {path!r} could not be read ({e}); give a .pt tensor of "
            "token ids"
        ) from e
    if (
        not isinstance(ids, torch.Tensor)
        or ids.dim() != 1
        or ids.is_floating_point()
        or ids.numel() == 0
    ):
        raise ValueError(
            f"--speculative-token-map {path!r} must hold a 1-D integer tensor of hot token ids"
        )
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(
            f"--speculative-token-map {path!r} has ids outside the vocabulary [0, {vocab_size})"
        )
    return ids.long()
