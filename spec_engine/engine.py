"""Engine: the in-process API, mirroring sglang.Engine.

The scheduler runs in one background thread; every call from the outside (generate, abort,
flush) is posted to it through a queue, and outputs come back through per-call channels, so
the sync API, the async API and the HTTP server share one code path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Optional, Union

import torch

from spec_engine.args.engine_args import EngineArgs, split_sglang_options
from spec_engine.args.resolve import EngineConfig, resolve_engine_config
from spec_engine.args.sglang_compat import check_sglang_options
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
from spec_engine.core.request import Req
from spec_engine.core.scheduler import Scheduler
from spec_engine.core.stats import RequestStats
from spec_engine.core.tokenizer import load_tokenizer
from spec_engine.mem.radix_cache import RadixCache
from spec_engine.runner.model_runner import ModelRunner
from spec_engine.speculative.factory import create_policy, create_worker
from spec_engine.weights.updater import WeightUpdater

logger = logging.getLogger(__name__)

_STOP = object()


class Engine(EngineControl):
    """Generation engine: `Engine(model_path=..., **engine_args)`; see EngineArgs for options."""

    def __init__(self, engine_args: Optional[EngineArgs] = None, **kwargs: Any) -> None:
        self.config = _resolve_config(engine_args, kwargs)
        self.args = args = self.config.args
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
        self.runner = ModelRunner(self.config)
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
        self.scheduler = Scheduler(
            args, worker, policy, tree_cache, eos_ids, decode_tail, self.runner.routing
        )
        self.inputs = self._request_builder(worker.decode_headroom())
        draft = getattr(worker, "draft", None)
        self.updater = WeightUpdater(self.runner.model, self.runner.device, draft)
        self.memory = MemoryController(
            self.scheduler, [self.runner] + ([draft] if draft is not None else []), self.updater
        )
        self.weight_version = args.weight_version
        self.model_path = args.model_path  # the target's checkpoint: updates from disk change it
        self.stats = RequestStats(log_requests=args.log_requests)
        self._weight_snapshot: Optional[dict[str, str]] = None
        self._profiler_ctl = Profiler()
        self._start_scheduler_thread()

    def _request_builder(self, kv_headroom: int) -> RequestBuilder:
        """What checks and builds requests, with this engine's limits."""
        args = self.args
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
        )

    def _start_scheduler_thread(self) -> None:
        """The thread that runs the scheduler and every command posted to it (see _loop)."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._inflight: set[str] = set()  # rids of requests not finished yet
        self._closed = False
        device = self.runner.device
        self._cuda_index: Optional[int] = (
            (device.index if device.index is not None else torch.cuda.current_device())
            if device.type == "cuda"
            else None
        )
        self._thread = threading.Thread(
            target=self._loop, name="spec-engine-scheduler", daemon=True
        )
        self._thread.start()

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
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
    ) -> Union[dict, list[dict], Iterator[dict]]:
        """Generate for one prompt (returns a dict) or a batch (a list, n samples per prompt in a
        row). With return_logprob, logprob_start_len >= 0 also scores the prompt from there
        (meta_info.input_token_logprobs); max_new_tokens 0 only scores it. For a batch, the
        log-prob arguments may be lists with one value per prompt, as in SGLang.
        return_routed_experts (with --enable-return-routed-experts, MoE models) adds SGLang's
        meta_info.routed_experts: base64 of int32 [prompt + output - 1 - routed_experts_start_len,
        num_hidden_layers, num_experts_per_tok], each token's experts (0 in dense layers).

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
            stream=stream,
            return_routed_experts=return_routed_experts,
            routed_experts_start_len=routed_experts_start_len,
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
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
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
            stream=stream,
            return_routed_experts=return_routed_experts,
            routed_experts_start_len=routed_experts_start_len,
        )
        # Tokenizing a long prompt takes seconds: off the event loop, which serves other requests.
        built = await asyncio.to_thread(self._make_requests, obj)
        collector = self._submit(built, Channel(self._thread.is_alive, asyncio.get_running_loop()))
        # Cancelled (an HTTP client went away) or closed early, the collector stops the work.
        return collector.astream() if stream else await collector.await_all()

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
                self._post(lambda: self.scheduler.abort_all(message))
            else:
                self._post(lambda: self.scheduler.abort(rid, message))

    def shutdown(self) -> None:
        """Abort whatever is in flight and stop the scheduler thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(_STOP)
        self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------ requests

    def _make_requests(self, obj: GenerateReqInput) -> tuple[list[Req], bool]:
        if self._closed:
            raise RuntimeError("engine is shut down")
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
        for index, req in enumerate(reqs):
            req.on_output = self._make_callback(index, channel)

        def add() -> None:
            for req in reqs:
                self.scheduler.add_request(req)

        self._post(add)
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
                self._post(lambda: self.scheduler.abort(req.input.rid, "the caller went away"))

        return on_output

    # ------------------------------------------------------------ scheduler thread

    def _post(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the scheduler thread between steps; its result comes back in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("engine is shut down")
            self._inbox.put((fn, future))
        return future

    def _call(self, fn: Callable[[], Any]) -> Any:
        return self._post(fn).result()

    def _loop(self) -> None:
        if self._cuda_index is not None:
            # This thread's CUDA calls (IPC handles of colocated pushes among them) must target
            # the engine's device, not the thread's default device 0.
            torch.cuda.set_device(self._cuda_index)
        while True:
            try:
                if not self._run_commands():
                    return
                if self._can_step():
                    self.scheduler.step()
            except Exception as e:
                logger.exception("engine step failed; failing the requests in flight")
                try:
                    self.scheduler.fail_all(f"engine error: {e!r}")
                except Exception:  # keep the thread alive: callers poll it
                    logger.exception("failing the requests in flight failed too")

    def _can_step(self) -> bool:
        return self.memory.generation_allowed and self.scheduler.has_work()

    def _run_commands(self) -> bool:
        """Run queued commands (waiting for one when idle); False once shut down."""
        try:
            item = self._inbox.get(block=not self._can_step())
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                self.scheduler.abort_all("engine shut down")
                return False
            fn, future = item
            try:
                future.set_result(fn())
            except Exception as e:  # handed to the caller through the future
                future.set_exception(e)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True


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
