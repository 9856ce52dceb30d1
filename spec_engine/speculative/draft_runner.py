"""DraftRunner: a draft model with its own KV pool, indexed by the target's slots.

The draft shares the target's slot allocator and request-to-token table: slot s holds the
target's K/V in the target pool and the draft's in this one. Embedding and LM head come from
the draft when it has its own (STANDALONE; an EAGLE-3 draft vocabulary), else from the target.
Draft ids map to target ids through `hot_ids` (EAGLE-3's d2t, or an FR-Spec token map).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from spec_engine.attention import make_backend
from spec_engine.forward_batch import ForwardBatch, ForwardMode
from spec_engine.runner.graph_runner import GraphRunner, SelfCheckBatches, build_graph_runners, self_check
from spec_engine.layers.linear import Linear
from spec_engine.mem.kv_pool import KVPool
from spec_engine.models.hf_config import ModelConfig
from spec_engine.runner.model_runner import ModelRunner, build_model, self_check_tolerance
from spec_engine.models.llama import LlamaForCausalLM
from spec_engine.models.llama_eagle import LlamaForCausalLMEagle
from spec_engine.models.llama_eagle3 import LlamaForCausalLMEagle3
from spec_engine.models.mimo import MiMoMTP

DRAFT_CLASSES = {"EAGLE": LlamaForCausalLMEagle, "EAGLE3": LlamaForCausalLMEagle3, "MTP": MiMoMTP,
                 "STANDALONE": LlamaForCausalLM}


class DraftRunner:
    def __init__(self, kind: str, config: ModelConfig, checkpoint: str, target: ModelRunner,
                 token_map: Optional[str] = None) -> None:
        self.kind = kind
        self.target = target
        self.device, self.dtype = target.device, target.dtype
        self.config = dataclasses.replace(config, rope_max_positions=target.model_config.rope_max_positions)
        self.model = build_model(DRAFT_CLASSES[kind], self.config, self.dtype, self.device, checkpoint,
                                 only_known=kind == "MTP")
        # Feature drafts read the target's final hidden states; EAGLE-3 reads three captured layers.
        self.uses_features = kind != "STANDALONE"
        if kind == "STANDALONE":
            self.embed, self.head = self.model.model.embed_tokens, self.model.lm_head
        else:
            self.embed = target.model.model.embed_tokens
            own = self.model.draft_head() if kind == "EAGLE3" else None
            self.head = own if own is not None else target.model.lm_head
        self.token_map = _load_token_map(token_map, config.vocab_size).to(self.device) if token_map is not None else None
        self.refresh()
        # An MTP draft is one layer of the target's shape (every other draft is all of its config).
        layers = 1 if kind == "MTP" else self.config.num_hidden_layers
        self.kv_pool = KVPool(target.max_total_tokens, target.args.page_size, layers,
                              self.config.num_key_value_heads, self.config.head_dim, self.dtype, self.device)
        self.attn_backend = make_backend(target.args.attention_backend, self.device, self.config, self.dtype)
        self.graphs = self._graph_runners()
        self.capture_graphs()
        if self.graphs and target.args.cuda_graph_self_check:
            self._self_check()

    def _graph_runners(self) -> dict[str, GraphRunner]:
        """Draft steps (topk rows per request, own KV indices), the STANDALONE root step, and
        the draft extend over a round's accepted tokens (up to steps + 1 per request)."""
        args = self.target.args
        if args.disable_cuda_graph or args.disable_draft_cuda_graph:
            return {}
        own = self.config.hidden_size if self.uses_features else None
        target = self.target.model_config.hidden_size * (3 if self.kind == "EAGLE3" else 1) if self.uses_features else None
        specs = {"steps": ("draft steps", ForwardMode.DECODE, args.speculative_eagle_topk, own, True),
                 "extend": ("draft extend", ForwardMode.DRAFT_EXTEND, args.speculative_num_steps + 1, target, False)}
        if not self.uses_features:
            specs["root"] = ("draft root", ForwardMode.DECODE, 1, None, False)
        return build_graph_runners(args, self.target.max_running_requests, self.target.req_to_token_pool.dummy_row,
                                   self.device, self.dtype, specs)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """(Re)capture every draft graph, in the target's memory pool."""
        for g in self.graphs.values():
            self.capture(g)

    def capture(self, g: GraphRunner) -> None:
        kv_width = self.target.req_to_token_pool.max_context_len
        if g.kv_rows:  # a tree step's row attends to its prefix, its path (steps - 1 nodes) and itself
            kv_width += self.target.args.speculative_num_steps
        g.capture(self._graph_forward, self._bind, kv_width, self.target.graph_pool,
                  check_inputs=self.target.args.cuda_graph_self_check)

    def release_graphs(self) -> None:
        for g in self.graphs.values():
            g.release()

    def _graph_forward(self, batch: ForwardBatch, hidden: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._forward(batch, hidden, metadata=False)

    def _graph_for(self, batch: ForwardBatch) -> Optional[GraphRunner]:
        if batch.mode is ForwardMode.DRAFT_EXTEND:
            return self.graphs.get("extend")
        if batch.mode is ForwardMode.DECODE:
            return self.graphs.get("steps" if batch.kv_indices is not None else "root")
        return None

    @torch.inference_mode()
    def _self_check(self) -> None:
        batches = SelfCheckBatches(self.target.req_to_token_pool, self.target.allocator, [self.kv_pool],
                                   self.config.vocab_size, self.device)
        self_check(list(self.graphs.values()), self._forward, batches, self_check_tolerance(self.dtype))

    def refresh(self) -> None:
        """Rebuild what derives from weights outside the draft model: the id map (EAGLE-3's d2t)
        and the FR-Spec head (hot rows of the target head). Call after any weight change."""
        self.hot_ids = self.token_map if self.token_map is not None else (
            self.model.hot_token_ids() if self.kind == "EAGLE3" else None)
        if self.hot_ids is not None and self.hot_ids.unique().numel() != self.hot_ids.numel():
            # Two draft ids for one target token would make sibling drafts repeat a token.
            raise ValueError("the draft vocabulary maps two ids to one target token (a repeated id in "
                             "--speculative-token-map, or in the EAGLE-3 draft's d2t); ids must be unique")
        if self.token_map is not None:
            rows = self.target.model.lm_head.weight.detach()[self.hot_ids]
            if not isinstance(self.head, Linear) or self.head is self.target.model.lm_head:
                self.head = Linear(self.config.hidden_size, len(self.hot_ids)).to(rows.dtype).to(rows.device)
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
        ids = d2t.long() + torch.arange(d2t.numel(), device=d2t.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.target.model_config.vocab_size):
            raise ValueError(f"weight 'draft.d2t' maps draft ids outside the target vocabulary "
                             f"[0, {self.target.model_config.vocab_size})")
        if ids.unique().numel() != ids.numel():
            raise ValueError("weight 'draft.d2t' maps two draft ids to one target token; ids must be unique")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (draft-vocabulary logits at batch.logits_indices (all rows if None), the
        features for the next draft step at the same rows)."""
        g = self._graph_for(batch)
        outs = g.run(batch, hidden) if g is not None else None
        return self._forward(batch, hidden) if outs is None else (outs[0], outs[1])

    def _forward(self, batch: ForwardBatch, hidden: Optional[torch.Tensor],
                 metadata: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        self._bind(batch)
        if metadata:
            self.attn_backend.init_forward_metadata(batch)
        embeds = self.embed(batch.input_ids)
        to_logits, to_next = self.model.draft_forward(embeds, batch.positions, batch, hidden)
        if batch.logits_indices is not None:
            to_logits, to_next = to_logits[batch.logits_indices], to_next[batch.logits_indices]
        return self.head(to_logits).float(), to_next

    def _bind(self, batch: ForwardBatch) -> None:
        batch.kv_pool = self.kv_pool
        batch.req_to_token_pool = self.target.req_to_token_pool
        batch.attn_backend = self.attn_backend

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.hot_ids is None else self.hot_ids[ids]


def _load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    try:
        ids = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"--speculative-token-map {path!r} could not be read ({e}); give a .pt tensor of token ids") from e
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.numel() == 0:
        raise ValueError(f"--speculative-token-map {path!r} must hold a 1-D integer tensor of hot token ids")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"--speculative-token-map {path!r} has ids outside the vocabulary [0, {vocab_size})")
    return ids.long()


def draft_kind(algorithm: str, draft_path: Optional[str]) -> str:
    """EAGLE without a draft path drafts with the target's MTP layers."""
    return "MTP" if algorithm == "EAGLE" and draft_path is None else algorithm


