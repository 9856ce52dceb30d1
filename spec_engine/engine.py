"""Engine: the in-process API, mirroring sglang.Engine.

The scheduler runs in one background thread; every call from the outside (generate, abort,
flush) is posted to it through a queue, and outputs come back through per-call channels, so
the sync API, the async API and the HTTP server share one code path.

At --tp-size N the engine is N ranks (SGLang's SPMD scheduler): this process is rank 0 and
spawns the others (distributed.launch), each holding its shard of the model and running the same
scheduler loop (engine_loop: rank 0 broadcasts the commands it receives every iteration).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Optional, Union

import torch

from spec_engine.args.engine_args import EngineArgs, split_sglang_options
from spec_engine.args.engine_checks import split_address
from spec_engine.args.resolve import EngineConfig, resolve_engine_config
from spec_engine.args.sglang_compat import check_sglang_options
from spec_engine.constrained.grammar import create_grammar_backend
from spec_engine.control import EngineControl
from spec_engine.core.channel import Channel, Collector
from spec_engine.core.inputs import (
    GenerateReqInput,
    InputIds,
    Params,
    Prompt,
    RequestBuilder,
    RequestLimits,
    routing_refusal,
)
from spec_engine.core.memory import MemoryController
from spec_engine.core.outputs import Delivery, RequestOutput
from spec_engine.core.profiling import Profiler
from spec_engine.core.request import Req, ReqInput
from spec_engine.core.scheduler import Scheduler
from spec_engine.core.scoring import Items, Query, label_scores, score_generate_kwargs
from spec_engine.core.stats import RequestStats
from spec_engine.core.tokenizer import load_tokenizer
from spec_engine.distributed.broadcast import broadcast_pyobj
from spec_engine.distributed.launch import RankFailed, Ranks
from spec_engine.distributed.parallel_state import SINGLE, TPGroup
from spec_engine.distributed.token_check import TokenCheck
from spec_engine.engine_loop import STOP, SchedulerLoop
from spec_engine.mem.radix_cache import RadixCache
from spec_engine.runner.model_runner import ModelRunner
from spec_engine.speculative.factory import create_policy, create_worker
from spec_engine.weights.updater import WeightUpdater

logger = logging.getLogger(__name__)


class Engine(EngineControl, SchedulerLoop):
    """Generation engine: `Engine(model_path=..., **engine_args)`; see EngineArgs for options."""

    def __init__(self, engine_args: Optional[EngineArgs] = None, **kwargs: Any) -> None:
        config = _resolve_config(engine_args, kwargs)
        args = config.args
        if args.node_rank > 0:
            raise ValueError(
                f"--node-rank {args.node_rank}: node 0 holds rank 0 and the Engine; run this "
                "node's ranks with `python -m spec_engine.launch_server --node-rank "
                f"{args.node_rank} ...` (or spec_engine.engine.serve_node), which serves nothing "
                "and returns when rank 0 stops the engine"
            )
        self._ranks: Optional[Ranks] = None
        tp = SINGLE
        if args.tp_size > 1:
            self._ranks = _node_ranks(config)
        try:
            with _on_base_gpu(args):
                if self._ranks is not None:
                    tp = self._ranks.connect()
                self._build(config, tp)
            if self._ranks is not None:
                self._ranks.report_ready()
                self._ranks.wait_ready()
        except BaseException as e:
            if self._ranks is None:
                raise
            self._ranks.report_failed(traceback.format_exc())  # for ranks on other nodes
            # A collective that failed on this rank: another rank died; say which and why.
            why = self._ranks.failure() if isinstance(e, torch.distributed.DistError) else None
            self._ranks.stop(timeout_s=0.0)
            if why is not None:
                raise RankFailed(why) from e
            raise
        self._start_scheduler_thread()

    @classmethod
    def _rank(cls, config: EngineConfig, tp: TPGroup) -> Engine:
        """Rank `tp.rank` > 0 of an engine: built as rank 0 is, serving rank 0's commands
        (`_loop` in its process's main thread)."""
        engine = cls.__new__(cls)
        engine._ranks = None
        engine._stopped_by = None
        engine._build(config, tp)
        return engine

    def _build(self, config: EngineConfig, tp: TPGroup) -> None:
        self.config = config
        self.tp = tp
        self.args = args = config.args
        self.model_config = self.config.target
        self.context_len = self.config.context_len
        self.tokenizer = (
            None
            if args.skip_tokenizer_init
            else load_tokenizer(args.tokenizer_path, args.chat_template)
        )
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        eos_ids = frozenset(eos)
        decode_tail = (
            (lambda ids: self.tokenizer.decode(ids)) if self.tokenizer is not None else None
        )
        self.runner = ModelRunner(self.config, tp)
        tree_cache = RadixCache(
            self.runner.allocator,
            self.runner.req_to_token_pool,
            args.page_size,
            disable=args.disable_radix_cache,
            next_token_keys=self.config.draft_kind is not None
            and self.config.draft_kind.uses_target_features,
        )
        worker = create_worker(self.config, self.runner, tree_cache.alloc_slots, eos_ids)
        policy = create_policy(args, worker)
        checked = TokenCheck(worker, tp) if tp.size > 1 and args.debug_tp_check_tokens else worker
        self.scheduler = Scheduler(
            args, checked, policy, tree_cache, eos_ids, decode_tail, self.runner.routing
        )
        if tp.size > 1:

            def rank0_value(value: Any) -> Any:
                return broadcast_pyobj([value], tp)[0]

            self.scheduler.rank0_value = policy.rank0_value = rank0_value
        self.inputs = self._request_builder(worker.decode_headroom(), eos_ids)
        draft = getattr(worker, "draft", None)
        self.updater = WeightUpdater(self.runner.model, self.runner.device, draft, self.runner.tp)
        self.memory = MemoryController(
            self.scheduler, [self.runner] + ([draft] if draft is not None else []), self.updater
        )
        self.weight_version = args.weight_version
        self.model_path = args.model_path  # the target's checkpoint: updates from disk change it
        self.stats = RequestStats(log_requests=args.log_requests)
        self._weight_snapshot: Optional[dict[str, str]] = None
        self._profiler_ctl = Profiler()
        self._lock = threading.Lock()
        self._submitted: dict[str, Req] = {}  # built, with their callbacks, not yet added
        device = self.runner.device
        self._cuda_index: Optional[int] = (
            (device.index if device.index is not None else torch.cuda.current_device())
            if device.type == "cuda"
            else None
        )

    def _request_builder(self, kv_headroom: int, eos_ids: frozenset[int]) -> RequestBuilder:
        """What checks and builds requests, with this engine's limits."""
        args = self.args
        grammars, grammar_refusal = create_grammar_backend(
            args,
            self.tokenizer,
            self.model_config.vocab_size,
            eos_ids,
            self.tp.size,
        )
        return RequestBuilder(
            self.tokenizer,
            self.model_config.vocab_size,
            self.context_len,
            self.runner.max_total_tokens,
            kv_headroom,
            args.page_size,
            args.random_seed,
            RequestLimits(
                args.max_request_prompts, args.max_request_samples, args.max_request_tokens
            ),
            routing_refusal(self.model_config.moe is not None, args.enable_return_routed_experts),
            grammars,
            grammar_refusal,
            args.enable_custom_logit_processor,
        )

    # ------------------------------------------------------------ generation

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        input_ids: InputIds = None,
        return_logprob: Union[bool, list[bool]] = False,
        top_logprobs_num: Union[int, list[int]] = 0,
        stream: bool = False,
        rid: Union[str, list[str], None] = None,
        logprob_start_len: Union[int, list[int]] = -1,
        token_ids_logprob: Union[list[int], list[list[int]], None] = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        custom_logit_processor: Union[str, list[Optional[str]], None] = None,
    ) -> Union[dict, list[dict], Iterator[dict]]:
        """Generate for one prompt (returns a dict) or a batch (a list, n samples per prompt in a
        row). With return_logprob, logprob_start_len >= 0 also scores the prompt from there
        (meta_info.input_token_logprobs); max_new_tokens 0 only scores it. For a batch, the
        log-prob arguments may be lists with one value per prompt, as in SGLang.
        token_ids_logprob (with return_logprob; a list of ids, or one per prompt) adds SGLang's
        meta_info.output_token_ids_logprobs: per output token, (logprob, id, None) of each id
        (and input_token_ids_logprobs for the prompt with logprob_start_len >= 0).
        return_routed_experts (with --enable-return-routed-experts, MoE models) adds SGLang's
        meta_info.routed_experts: base64 of int32 [prompt + output - 1 - routed_experts_start_len,
        num_hidden_layers, num_experts_per_tok], each token's experts (0 in dense layers).
        custom_logit_processor (with --enable-custom-logit-processor): SGLang's
        CustomLogitProcessor.to_str(), run on the request's logits with its custom_params.

        With stream=True returns an iterator of cumulative output dicts (batch items carry "index").
        """
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            rid=rid,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob,
            stream=stream,
            return_routed_experts=return_routed_experts,
            routed_experts_start_len=routed_experts_start_len,
            custom_logit_processor=custom_logit_processor,
        )
        collector = self._submit(self._make_requests(obj), Channel(self._thread.is_alive))
        return collector.stream() if stream else collector.wait()

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        input_ids: InputIds = None,
        return_logprob: Union[bool, list[bool]] = False,
        top_logprobs_num: Union[int, list[int]] = 0,
        stream: bool = False,
        rid: Union[str, list[str], None] = None,
        logprob_start_len: Union[int, list[int]] = -1,
        token_ids_logprob: Union[list[int], list[list[int]], None] = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        custom_logit_processor: Union[str, list[Optional[str]], None] = None,
    ) -> Union[dict, list[dict], AsyncIterator[dict]]:
        """Async form of `generate`; with stream=True returns an async iterator."""
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            rid=rid,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob,
            stream=stream,
            return_routed_experts=return_routed_experts,
            routed_experts_start_len=routed_experts_start_len,
            custom_logit_processor=custom_logit_processor,
        )
        # Tokenizing a long prompt takes seconds: off the event loop, which serves other requests.
        built = await asyncio.to_thread(self._make_requests, obj)
        collector = self._submit(built, Channel(self._thread.is_alive, asyncio.get_running_loop()))
        # Cancelled (an HTTP client went away) or closed early, the collector stops the work.
        return collector.astream() if stream else await collector.await_all()

    def score(
        self,
        query: Query = None,
        items: Items = None,
        label_token_ids: Optional[list[int]] = None,
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:
        """SGLang's Engine.score: per item, each label token's probability right after query +
        item (item + query with item_first); /v1/score answers the same (core/scoring.py)."""
        kwargs = score_generate_kwargs(
            query, items, label_token_ids, item_first, self.model_config.vocab_size
        )
        if kwargs is None:
            return []
        return [label_scores(o, label_token_ids, apply_softmax) for o in self.generate(**kwargs)]

    async def async_score(
        self,
        query: Query = None,
        items: Items = None,
        label_token_ids: Optional[list[int]] = None,
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:
        """Async form of `score`."""
        kwargs = score_generate_kwargs(
            query, items, label_token_ids, item_first, self.model_config.vocab_size
        )
        if kwargs is None:
            return []
        outs = await self.async_generate(**kwargs)
        return [label_scores(o, label_token_ids, apply_softmax) for o in outs]

    # ------------------------------------------------------------ control

    def abort_request(
        self,
        rid: Optional[str] = None,
        abort_all: bool = False,
        message: Optional[str] = None,
    ) -> None:
        """Abort a request (or all n samples of one) by rid, or every request with abort_all;
        each finishes with finish_reason abort and its output so far (message None: SGLang's
        "Abort in waiting queue" for a queued request, "aborted by request" for a running one)."""
        if rid is None and not abort_all:
            raise ValueError("abort_request needs a rid, or abort_all=True")
        if not self._closed:  # after shutdown every request has been aborted already
            if abort_all:
                self._post_command("scheduler.abort_all", message)
            else:
                self._post_command("scheduler.abort", rid, message)

    def shutdown(self) -> None:
        """Abort whatever is in flight and stop the scheduler thread (and the other ranks)."""
        with self._lock:
            running = not self._closed
            self._closed = True
            if running:
                self._inbox.put((STOP, None))
        if running:
            self._thread.join(timeout=30)
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------ requests

    def _make_requests(self, obj: GenerateReqInput) -> tuple[list[Req], bool]:
        if self._closed:
            raise RuntimeError(self._closed_message())
        return self.inputs.build(obj)

    def _submit(self, built: tuple[list[Req], bool], channel: Channel) -> Collector:
        """Hand the requests to the scheduler; their outputs come back through `channel`."""
        reqs, single = built
        rids = [req.input.rid for req in reqs]
        with self._lock:
            taken = [r for r in rids if r in self._inflight]
            if taken or len(set(rids)) < len(rids):
                raise ValueError(
                    f"Duplicate request ID detected: {(taken or rids)[0]} (in flight, or twice "
                    "in this batch); give each request a unique rid (or none)"
                )
            self._inflight.update(rids)
            self._submitted.update(zip(rids, reqs))
        for index, req in enumerate(reqs):
            req.on_output = self._make_callback(index, channel)
        self._post_command("_add_requests", tuple(req.input for req in reqs))
        outputs = [RequestOutput(req, self.tokenizer) for req in reqs]
        return Collector(outputs, single, channel, self.abort_request)

    def _make_callback(self, index: int, channel: Channel) -> Callable[[Req, bool], None]:
        def on_output(req: Req, finished: bool) -> None:
            alarm = self.scheduler.policy.accept_alarm  # on the scheduler thread: it calls this
            delivered = channel.put(
                Delivery.of(
                    index,
                    req,
                    finished,
                    self.weight_version,
                    self.args.speculative_algorithm is not None,
                    alarm,
                )
            )
            if finished:
                self.stats.record(req)
                with self._lock:
                    self._inflight.discard(req.input.rid)
            if not delivered and not finished and not self._closed:
                self._post_command("scheduler.abort", req.input.rid, "the caller went away")

        return on_output

    def _add_requests(self, inputs: tuple[ReqInput, ...]) -> None:
        """Queue requests (a Command): rank 0's as it built them, with their callbacks; the
        other ranks' from what rank 0 broadcast."""
        for inp in inputs:
            with self._lock:
                req = self._submitted.pop(inp.rid, None)
            self.scheduler.add_request(req if req is not None else Req(inp))


def _resolve_config(engine_args: Optional[EngineArgs], kwargs: dict[str, Any]) -> EngineConfig:
    """The engine's arguments (engine_args updated by kwargs, SGLang's options split off) and
    what they resolve to; sets the log level and warns about SGLang options specrl ignores."""
    kwargs = split_sglang_options(kwargs)
    args = (
        dataclasses.replace(engine_args, **kwargs)
        if engine_args is not None
        else EngineArgs(**kwargs)
    )
    logging.getLogger("spec_engine").setLevel(args.log_level.upper())
    for line in check_sglang_options(args.sglang_options):
        logger.warning(line)
    return resolve_engine_config(args, cuda_available=torch.cuda.is_available())


def _on_base_gpu(args: EngineArgs) -> contextlib.AbstractContextManager:
    """Build rank 0 on GPU --base-gpu-id (SGLang's gpu_id for rank 0; rank r is on
    --base-gpu-id + r): its "cuda" tensors, and the scheduler thread's device (_cuda_index)."""
    if args.device == "cuda" and (args.tp_size > 1 or args.base_gpu_id):
        return torch.cuda.device(args.base_gpu_id)
    return contextlib.nullcontext()


def _serve_rank(config: EngineConfig, tp: TPGroup, ready: Callable[[], None]) -> None:
    """A spawned rank's life (distributed.launch): build its engine, report ready, then run the
    scheduler loop on rank 0's commands until rank 0 stops it."""
    logging.basicConfig(
        level=config.args.log_level.upper(),
        format=f"[%(asctime)s TP{tp.rank} %(name)s] %(message)s",
    )
    engine = Engine._rank(config, tp)
    ready()
    engine._loop()
    if engine.stopped_by is not None:
        raise RuntimeError(engine.stopped_by)


def _node_ranks(config: EngineConfig) -> Ranks:
    """The ranks this node starts beside its process's own (every rank but rank 0's own at
    --nnodes 1)."""
    args = config.args
    return Ranks(
        _serve_rank,
        config,
        args.tp_size,
        torch.device(args.device),
        split_address(args.dist_init_addr),
        args.base_gpu_id,
        args.dist_timeout,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
    )


def serve_node(engine_args: EngineArgs) -> None:
    """Node --node-rank > 0 of a multi-node engine (SGLang's launch_server at node_rank >= 1):
    run this node's ranks, this process being the first, until rank 0 stops the engine; serves
    nothing. Raises if a rank fails or rank 0 goes away without stopping it."""
    config = _resolve_config(engine_args, {})
    args = config.args
    if args.nnodes == 1 or args.node_rank == 0:
        raise ValueError("serve_node runs a node > 0 of --nnodes > 1; node 0 runs the Engine")
    ranks = _node_ranks(config)
    try:
        if args.device == "cuda":
            torch.cuda.set_device(args.base_gpu_id)
        else:
            torch.set_num_threads(max(1, torch.get_num_threads() // ranks.per_node))
        try:
            tp = ranks.connect()
            engine = Engine._rank(config, tp)
            ranks.report_ready()
            ranks.wait_ready()
        except BaseException:
            ranks.report_failed(traceback.format_exc())
            raise
        logger.info("node %d: ranks %d..%d serve", args.node_rank, ranks.rank, ranks.local.stop - 1)
        engine._loop()
        if engine.stopped_by is not None:
            raise RuntimeError(f"node {args.node_rank}: {engine.stopped_by}")
    finally:
        ranks.stop()
