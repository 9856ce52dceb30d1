"""Routed-expert capture for rollout routing replay (slime's R3; SGLang's
--enable-return-routed-experts).

Every MoE layer's top-k expert ids are written, per token, at the token's KV slot: the store is
laid out like the KV pool ([layers, slots, top_k]) and written the way K/V are (index_copy_ at
out_cache_loc). Three things follow, each as for K/V:
  * a prefix-cache hit reports the routing its cached tokens were computed with (the slots keep
    it), as SGLang's host buffer indexed by out_cache_loc does;
  * a speculative verify writes every draft token's routing, and the accepted ones are kept by
    moving them with their KV (spec_engine.speculative.base); the draft model never writes;
  * a captured graph (CUDA, or its CPU emulation) writes the same static store through the
    static out_cache_loc buffer; padded rows land in the reserved dummy slot 0.
Layers without experts (GLM-4.5's first_k_dense_replace) keep 0, as SGLang reports them.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Optional

import torch
from torch import nn

from spec_engine.layers.moe import SparseMoE

_TRUNK_MLP = re.compile(r"model\.layers\.(\d+)\.mlp")


class RoutingCapture:
    """Expert ids per (layer, KV slot); `bind` names the slots the next forward writes."""

    def __init__(self, num_slots: int, num_layers: int, top_k: int, device: torch.device) -> None:
        self.store = torch.zeros(num_layers, num_slots, top_k, dtype=torch.int32, device=device)
        self.loc: Optional[torch.Tensor] = None

    def bind(self, out_cache_loc: Optional[torch.Tensor]) -> None:
        """The KV slots of the forward about to run (None after it: a forward of the same
        modules that is not the target's, e.g. a self-drafting STANDALONE draft, writes
        nothing)."""
        self.loc = out_cache_loc

    def record(self, layer_id: int, ids: torch.Tensor) -> None:
        if self.loc is not None:
            self.store[layer_id].index_copy_(0, self.loc, ids.to(torch.int32))

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Routing follows KV when accepted draft tokens are compacted into earlier slots."""
        for layer in self.store:
            layer.index_copy_(0, dst, layer.index_select(0, src))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """[len(slots), num_layers, top_k] int32 on the CPU, in slot order."""
        return self.store.index_select(1, slots).permute(1, 0, 2).contiguous().cpu()


def attach_routing_capture(model: nn.Module, capture: RoutingCapture, num_layers: int) -> int:
    """Point every trunk MoE layer of `model` (`model.layers.{i}.mlp` a SparseMoE with i below
    `num_layers`: GLM-4.5's, and any model built from the same pieces) at `capture`; returns
    how many. Next-n (MTP) layers past the trunk are left out: SGLang reports
    num_hidden_layers layers."""
    attached = 0
    for name, module in model.named_modules():
        found = _TRUNK_MLP.fullmatch(name)
        if isinstance(module, SparseMoE) and found and int(found[1]) < num_layers:
            module.routing_sink = partial(capture.record, int(found[1]))
            attached += 1
    return attached
