"""RunnerBase: what the target and the draft runner share.

A runner owns one model, the KV pool its layers write, and its attention backend; it reads the
request-to-token table and the slot allocator (the target's, which a draft shares). Its forward
modes that graphs can replay are described as data (GraphSpec); the base builds their graph
runners, captures them (again after memory is resumed), runs the startup self-check, and
replays a batch when a graph fits it. Subclasses say how the model runs eagerly (`_forward`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

from spec_engine.args.engine_args import EngineArgs
from spec_engine.attention import make_backend
from spec_engine.forward_batch import ForwardBatch
from spec_engine.layers import fused
from spec_engine.layers.batch_invariant import set_batch_invariant
from spec_engine.mem.allocator import PageAllocator
from spec_engine.mem.kv_pool import KVPool, ReqToTokenPool
from spec_engine.models.hf_config import ModelConfig
from spec_engine.runner.graph_capture import Outputs
from spec_engine.runner.graph_runner import GraphRunner, GraphSpec, build_graph_runners
from spec_engine.runner.self_check import SelfCheckBatches, self_check, self_check_tolerance


class RunnerBase:
    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        model: nn.Module,
        kv_pool: KVPool,
        table: ReqToTokenPool,
        allocator: PageAllocator,
        max_running_requests: int,
        graph_pool: Any,
        graph_specs: Sequence[GraphSpec],
    ) -> None:
        self.args = args
        self.model_config = model_config
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token_pool = table
        self.allocator = allocator
        self.device = kv_pool.device
        self.dtype = kv_pool.dtype
        self.graph_pool = graph_pool
        if args.enable_deterministic_inference:
            set_batch_invariant(model)
        kernels = fused.kernels_for(
            self.device, args.attention_backend, args.enable_deterministic_inference
        )
        # Before any graph is captured (the graphs launch them); what took which kernel.
        self.fused_kernels = fused.install(model, kv_pool, kernels) if kernels else {}
        self.attn_backend = make_backend(
            args.attention_backend,
            self.device,
            model_config,
            self.dtype,
            batch_invariant=args.enable_deterministic_inference,
        )
        self.graphs: list[GraphRunner] = []
        if graph_specs:
            self.graphs = build_graph_runners(
                args, max_running_requests, table.dummy_row, self.device, self.dtype, graph_specs
            )
        self.capture_graphs()
        if self.graphs and args.cuda_graph_self_check:
            self._self_check()

    def _forward(
        self, batch: ForwardBatch, features: Optional[torch.Tensor] = None, metadata: bool = True
    ) -> Outputs:
        """The model over `batch`, eagerly: logits first, then the features drafts read.
        `metadata=False` inside a captured graph, whose batch carries static metadata."""
        raise NotImplementedError

    def graph_for(self, batch: ForwardBatch) -> Optional[GraphRunner]:
        """The graph runner of the batch's kind; where several widths are captured (target
        verify under --speculative-adaptive, narrowest first), the narrowest that holds its
        widest request (else the widest, which runs it eagerly)."""
        kind = [g for g in self.graphs if g.spec.matches(batch)]
        if len(kind) > 1:
            widest = max(batch.extend_seq_lens_cpu)
            return next((g for g in kind if g.width >= widest), kind[-1])
        return kind[0] if kind else None

    def _replay(self, batch: ForwardBatch, features: Optional[torch.Tensor]) -> Optional[Outputs]:
        """The batch's outputs from a captured graph, or None when it must run eagerly."""
        g = self.graph_for(batch)
        return g.run(batch, features) if g is not None else None

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """(Re)capture every graph: at startup, and whenever the tensors they read were replaced
        (KV pool or weights released and resumed)."""
        for g in self.graphs:
            self.capture(g)

    def capture(self, g: GraphRunner) -> None:
        g.capture(
            self._graph_forward,
            self._bind,
            self.req_to_token_pool.max_context_len,
            self.graph_pool,
            check_inputs=self.args.cuda_graph_self_check,
        )

    def release_graphs(self) -> None:
        for g in self.graphs:
            g.release()

    def _graph_forward(self, batch: ForwardBatch, features: Optional[torch.Tensor]) -> Outputs:
        return self._forward(batch, features, metadata=False)

    def _bind(self, batch: ForwardBatch) -> None:
        batch.kv_pool = self.kv_pool
        batch.req_to_token_pool = self.req_to_token_pool
        batch.attn_backend = self.attn_backend

    def _prepare(self, batch: ForwardBatch, metadata: bool) -> None:
        """Bind the batch to this runner's memory and backend (and, eagerly, build its metadata)."""
        self._bind(batch)
        if metadata:
            self.attn_backend.init_forward_metadata(batch)

    @torch.inference_mode()
    def _self_check(self) -> None:
        batches = SelfCheckBatches(
            self.req_to_token_pool,
            self.allocator,
            [self.kv_pool],
            self.model_config.vocab_size,
            self.device,
        )
        self_check(self.graphs, self._forward, batches, self_check_tolerance(self.dtype))
