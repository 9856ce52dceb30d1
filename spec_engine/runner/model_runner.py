"""ModelRunner: owns the model, its KV memory and attention backend; runs one forward batch."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from spec_engine.attention import make_backend
from spec_engine.args.engine_args import EngineArgs
from spec_engine.forward_batch import ForwardBatch, ForwardMode
from spec_engine.runner.graph_capture import new_pool
from spec_engine.runner.graph_runner import GraphRunner, SelfCheckBatches, build_graph_runners, self_check
from spec_engine.mem.allocator import PageAllocator
from spec_engine.mem.kv_pool import KVPool, ReqToTokenPool
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models import model_class
from spec_engine.weights.loader import load_checkpoint

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ForwardOutput:
    logits: torch.Tensor               # float32, at batch.logits_indices (all rows when None)
    hidden: torch.Tensor               # final hidden states, all rows when batch.capture_hidden
    aux_hidden: Optional[torch.Tensor]  # captured layer inputs (EAGLE-3 targets), same rows


def build_model(model_cls: type[nn.Module], config: ModelConfig, dtype: torch.dtype, device: torch.device,
                checkpoint: str, only_known: bool = False) -> nn.Module:
    """Instantiate and load a model: built on the meta device and allocated once on the target
    device, so no time goes to a random initialisation that loading overwrites."""
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to(dtype).to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    load_checkpoint(model, checkpoint, only_known=only_known)
    return model.eval().requires_grad_(False)


class ModelRunner:
    """The target model with its KV pool, slot allocator and request-to-token table.

    `extra_positions`: positions past the context length a forward may touch (speculative
    tokens verified beyond a request's last position before they are cut).
    """

    def __init__(self, model_config: ModelConfig, args: EngineArgs, extra_positions: int = 0) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = DTYPES[args.dtype]
        self.context_len = context_length(model_config, args)
        rope_rows = max(model_config.max_position_embeddings, self.context_len) + extra_positions
        self.model_config = dataclasses.replace(model_config, rope_max_positions=rope_rows)
        if self.model_config.is_draft:
            raise ValueError(f"--model-path is a {model_config.architecture} draft; pass it as "
                             "--speculative-draft-model-path and give the target model as --model-path")
        self.model = build_model(model_class(self.model_config), self.model_config, self.dtype, self.device,
                                 args.model_path)
        self.max_running_requests = args.max_running_requests
        self.max_total_tokens = self._kv_pool_tokens()
        self.kv_pool = KVPool(self.max_total_tokens, args.page_size, model_config.num_hidden_layers,
                              model_config.num_key_value_heads, model_config.head_dim, self.dtype, self.device)
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_len + extra_positions,
                                                self.device)
        self.allocator = PageAllocator(self.max_total_tokens, args.page_size, self.device)
        self.attn_backend = make_backend(args.attention_backend, self.device, self.model_config, self.dtype)
        self.graph_pool = new_pool(self.device) if not args.disable_cuda_graph else None
        self.graphs = self._graph_runners()
        self.capture_graphs()
        if args.cuda_graph_self_check:
            self._self_check()
        logger.info("model %s loaded on %s (%s): KV pool of %d tokens, %.1f MiB",
                    model_config.architecture, self.device, args.dtype, self.max_total_tokens,
                    self.kv_pool.nbytes() / 2**20)

    def weight_bytes(self) -> int:
        params = {p.data_ptr(): p for p in self.model.parameters()}
        return sum(p.numel() * p.element_size() for p in params.values())

    def _kv_pool_tokens(self) -> int:
        args, page = self.args, self.args.page_size
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
        else:
            per_token = self.model_config.kv_elements_per_token * torch.tensor([], dtype=self.dtype).element_size()
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = free - total * (1.0 - args.mem_fraction_static)
            else:
                total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                budget = total * args.mem_fraction_static - self.weight_bytes()
            tokens = int(budget // per_token)
            # More than every running request at full context can never be used.
            tokens = min(tokens, self.max_running_requests * self.context_len)
        tokens = tokens // page * page
        if tokens < 2 * page:
            raise ValueError(f"KV cache would hold only {tokens} tokens; raise --mem-fraction-static or set --max-total-tokens")
        return tokens

    def _graph_runners(self) -> dict[ForwardMode, GraphRunner]:
        """Target decode, and target verify under speculation (num_draft_tokens per request)."""
        args = self.args
        if args.disable_cuda_graph:
            return {}
        widths = {ForwardMode.DECODE: 1}
        if args.speculative_algorithm is not None:
            widths[ForwardMode.TARGET_VERIFY] = args.speculative_num_draft_tokens
        graphs = build_graph_runners(args, self.max_running_requests, self.req_to_token_pool.dummy_row, self.device,
                                     self.dtype,
                                     {mode: (f"target {mode.value}", mode, w, None, False) for mode, w in widths.items()})
        logger.info("graph batch sizes: %s%s", graphs[ForwardMode.DECODE].sizes, "" if self.device.type == "cuda"
                    else " (no CUDA: graphs are emulated, padded batches replay eagerly)")
        if self.device.type == "cuda" and args.attention_backend == "torch_native":
            logger.warning("torch_native CUDA graphs are captured on first use per power-of-two key width (up to %d); "
                           "use --attention-backend flashinfer for long contexts", self.req_to_token_pool.max_context_len)
        return graphs

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """(Re)capture every graph: at startup, and whenever the tensors they read were replaced
        (KV pool or weights released and resumed)."""
        for g in self.graphs.values():
            self.capture(g)

    def capture(self, g: GraphRunner) -> None:
        g.capture(self._graph_forward, self._bind, self.req_to_token_pool.max_context_len, self.graph_pool,
                  check_inputs=self.args.cuda_graph_self_check)

    def release_graphs(self) -> None:
        for g in self.graphs.values():
            g.release()

    def _graph_forward(self, batch: ForwardBatch, _features: Optional[torch.Tensor]) -> tuple:
        out = self._forward(batch, metadata=False)
        return out.logits, out.hidden, out.aux_hidden

    @torch.inference_mode()
    def _bind(self, batch: ForwardBatch) -> None:
        batch.kv_pool = self.kv_pool
        batch.req_to_token_pool = self.req_to_token_pool
        batch.attn_backend = self.attn_backend

    @torch.inference_mode()
    def _self_check(self) -> None:
        def forward(batch: ForwardBatch, _features: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            out = self._forward(batch)
            return out.logits, out.hidden

        batches = SelfCheckBatches(self.req_to_token_pool, self.allocator, [self.kv_pool],
                                   self.model_config.vocab_size, self.device)
        self_check(list(self.graphs.values()), forward, batches, self_check_tolerance(self.dtype))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        g = self.graphs.get(batch.mode)
        outs = g.run(batch) if g is not None else None
        if outs is None:
            return self._forward(batch)
        # Graph modes compute logits and hidden states at every token row.
        return ForwardOutput(*outs)

    def _forward(self, batch: ForwardBatch, metadata: bool = True) -> ForwardOutput:
        """The model over `batch`; `metadata=False` in a captured graph, whose batch carries static metadata."""
        self._bind(batch)
        if metadata:
            self.attn_backend.init_forward_metadata(batch)
        hidden, aux = self.model(batch.input_ids, batch.positions, batch)
        rows = batch.logits_indices
        at_rows = hidden if rows is None else hidden[rows]
        logits = self.model.compute_logits(at_rows)
        if not batch.capture_hidden:
            hidden, aux = at_rows, (None if aux is None else aux if rows is None else aux[rows])
        return ForwardOutput(logits, hidden, aux)


def self_check_tolerance(dtype: torch.dtype) -> float:
    """Padded and eager runs differ only in reduction order: float32 agrees to ~1e-6."""
    return 1e-3 if dtype == torch.float32 else 5e-2


def context_length(model_config: ModelConfig, args: EngineArgs) -> int:
    limit = model_config.max_position_embeddings
    if args.context_length is None:
        return limit
    if args.context_length > limit:
        raise ValueError(f"--context-length {args.context_length} exceeds the model's max_position_embeddings ({limit}); lower it")
    return args.context_length
