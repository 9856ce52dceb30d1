"""ModelRunner: the target model with its KV pool, slot allocator and request-to-token table.

Under tensor parallelism each rank's runner holds its shard of the model and a KV pool of its
own KV heads; the pool's size in tokens is what every rank can hold (the smallest)."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import NamedTuple, Optional

import torch

from spec_engine.args.resolve import EngineConfig
from spec_engine.args.spec_shapes import spec_shapes
from spec_engine.distributed.parallel_state import SINGLE, TPGroup, use_tp_group
from spec_engine.distributed.partition import attention_heads
from spec_engine.dtypes import DTYPES
from spec_engine.forward_batch import ForwardBatch, ForwardMode
from spec_engine.layers.routing_capture import RoutingCapture, attach_routing_capture
from spec_engine.mem.allocator import PageAllocator
from spec_engine.mem.kv_pool import KVPool, MLAKVPool, ReqToTokenPool
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.registry import model_class
from spec_engine.runner.base import RunnerBase
from spec_engine.runner.graph_capture import new_pool
from spec_engine.runner.graph_runner import GraphSpec
from spec_engine.weights.loader import build_model

logger = logging.getLogger(__name__)


class ForwardOutput(NamedTuple):
    logits: torch.Tensor  # float32, at batch.logits_indices (all rows when None)
    hidden: torch.Tensor  # final hidden states, all rows when batch.capture_hidden
    aux_hidden: Optional[torch.Tensor]  # captured layer inputs (EAGLE-3 targets), same rows


class ModelRunner(RunnerBase):
    """The target. Its request-to-token rows reach `config.extra_positions` past the context
    length: speculative tokens are verified beyond a request's last position before they are cut."""

    def __init__(self, config: EngineConfig, tp: TPGroup = SINGLE) -> None:
        args = config.args
        device, dtype = torch.device(args.device), DTYPES[args.dtype]
        self.context_len = config.context_len
        self.max_running_requests = args.max_running_requests
        # --ep-size: how the MoE layers built here place their experts (layers/moe.py).
        self.tp = tp = dataclasses.replace(tp, ep_size=args.ep_size)
        with use_tp_group(tp):
            model = build_model(
                model_class(config.target),
                config.target,
                dtype,
                device,
                args.model_path,
                capture_layers=config.capture_layers,
            )
        # The target as this rank runs it: its heads (all of them at one rank).
        target = rank_config(config.target, tp)
        self.max_total_tokens = tp.min(kv_pool_tokens(config, model, dtype, target, tp.size))
        kv_pool = new_kv_pool(
            target, self.max_total_tokens, args.page_size, target.num_hidden_layers, dtype, device
        )
        table = ReqToTokenPool(
            self.max_running_requests, self.context_len + config.extra_positions, device
        )
        allocator = PageAllocator(self.max_total_tokens, args.page_size, device)
        # Before the graphs are captured: they write the routing store.
        self.routing = (
            routing_capture(target, model, self.max_total_tokens, device)
            if args.enable_return_routed_experts
            else None
        )
        graph_pool = new_pool(device) if not args.disable_cuda_graph else None
        super().__init__(
            args,
            target,
            model,
            kv_pool,
            table,
            allocator,
            self.max_running_requests,
            graph_pool,
            self._graph_specs(args),
        )
        self._log_graphs()
        logger.info(
            "model %s loaded on %s (%s): KV pool of %d tokens, %.1f MiB",
            target.architecture,
            self.device,
            args.dtype,
            self.max_total_tokens,
            kv_pool.nbytes() / 2**20,
        )

    @staticmethod
    def _graph_specs(args) -> list[GraphSpec]:
        """Target decode, and target verify under speculation (num_draft_tokens per request;
        with --speculative-adaptive also each shallower shape's token count, narrowest first, so
        a shallow verify replays a graph of its own width instead of padding every request to
        the deepest: RunnerBase.graph_for)."""
        if args.disable_cuda_graph:
            return []
        specs = [GraphSpec("target decode", ForwardMode.DECODE, 1)]
        if args.speculative_algorithm is not None:
            widths = sorted({s.draft_tokens for s in spec_shapes(args, args.speculative_adaptive)})
            specs.extend(
                GraphSpec(
                    "target target_verify"
                    + ("" if width == args.speculative_num_draft_tokens else f" of {width}"),
                    ForwardMode.TARGET_VERIFY,
                    width,
                )
                for width in widths
            )
        return specs

    def _log_graphs(self) -> None:
        if not self.graphs:
            return
        logger.info(
            "graph batch sizes: %s%s",
            self.graphs[0].sizes,
            ""
            if self.device.type == "cuda"
            else " (no CUDA: graphs are emulated, padded batches replay eagerly)",
        )
        if self.device.type == "cuda" and self.args.attention_backend == "torch_native":
            logger.warning(
                "torch_native CUDA graphs are captured on first use per power-of-two key width (up "
                "to "
                "%d); use --attention-backend flashinfer for long contexts",
                self.req_to_token_pool.max_context_len,
            )

    def weight_bytes(self) -> int:
        return model_weight_bytes(self.model)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        outs = self._replay(batch, None)
        # Graph modes compute logits and hidden states at every token row.
        return self._forward(batch, None) if outs is None else ForwardOutput(*outs)

    def _forward(
        self, batch: ForwardBatch, features: Optional[torch.Tensor] = None, metadata: bool = True
    ) -> ForwardOutput:
        self._prepare(batch, metadata)
        if self.routing is None:
            hidden, aux = self.model(batch.input_ids, batch.positions, batch)
        else:
            self.routing.bind(batch.out_cache_loc)
            try:
                hidden, aux = self.model(batch.input_ids, batch.positions, batch)
            finally:
                self.routing.bind(None)
        rows = batch.logits_indices
        at_rows = hidden if rows is None else hidden[rows]
        logits = self.model.compute_logits(at_rows)
        if not batch.capture_hidden:
            hidden, aux = at_rows, (None if aux is None else aux if rows is None else aux[rows])
        return ForwardOutput(logits, hidden, aux)


def new_kv_pool(
    config: ModelConfig,
    num_tokens: int,
    page_size: int,
    num_layers: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVPool:
    """The KV pool `config`'s attention reads: per-head K/V, or MLA's latent cache."""
    if config.mla is not None:
        m = config.mla
        return MLAKVPool(
            num_tokens, page_size, num_layers, m.cache_dim, m.kv_lora_rank, dtype, device
        )
    return KVPool(
        num_tokens,
        page_size,
        num_layers,
        config.num_key_value_heads,
        config.head_dim,
        dtype,
        device,
    )


def routing_capture(
    target: ModelConfig, model: torch.nn.Module, num_slots: int, device: torch.device
) -> RoutingCapture:
    """The routed-expert store of --enable-return-routed-experts; refused for a dense model."""
    if target.moe is None:
        raise ValueError(
            f"--enable-return-routed-experts: {target.architecture} has no MoE layers to report "
            "routed experts for; drop the flag (routing replay needs a MoE model, e.g. GLM-4.5)"
        )
    capture = RoutingCapture(num_slots, target.num_hidden_layers, target.moe.top_k, device)
    if attach_routing_capture(model, capture, target.num_hidden_layers) == 0:
        raise ValueError(
            f"--enable-return-routed-experts: found no MoE layer (model.layers.N.mlp) in "
            f"{target.architecture}; drop the flag"
        )
    return capture


def model_weight_bytes(model: torch.nn.Module) -> int:
    params = {p.data_ptr(): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def rank_config(target: ModelConfig, tp: TPGroup) -> ModelConfig:
    """`target` with this rank's attention heads (what its KV pool and attention backend hold)."""
    if tp.size == 1:
        return target
    heads = attention_heads(
        target.num_attention_heads, target.num_key_value_heads, tp.rank, tp.size
    )
    return dataclasses.replace(target, num_attention_heads=heads.q, num_key_value_heads=heads.kv)


def kv_pool_tokens(
    config: EngineConfig,
    model: torch.nn.Module,
    dtype: torch.dtype,
    target: Optional[ModelConfig] = None,
    ranks_per_host: int = 1,
) -> int:
    """KV pool size: --max-total-tokens, else what --mem-fraction-static leaves after the weights
    (never more than every running request at full context), in whole pages. `target`: the
    model as this rank holds it (its KV heads); on the CPU the `ranks_per_host` ranks of one
    engine share the host's memory fraction."""
    args, page = config.args, config.args.page_size
    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens
    else:
        target = target or config.target
        per_token = (
            target.kv_elements_per_token
            * torch.tensor([], dtype=dtype, device="cpu").element_size()
        )
        device = torch.device(args.device)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = free - total * (1.0 - args.mem_fraction_static)
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            share = total * args.mem_fraction_static / ranks_per_host
            budget = share - model_weight_bytes(model)
        tokens = int(budget // per_token)
        tokens = min(tokens, args.max_running_requests * config.context_len)
    tokens = tokens // page * page
    if tokens < 2 * page:
        raise ValueError(
            f"KV cache would hold only {tokens} tokens; raise --mem-fraction-static or set "
            "--max-total-tokens"
        )
    return tokens
