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
import uuid
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Union

import torch

import spec_engine
from spec_engine.config import EngineArgs, resolve_auto, resolve_speculative, speculative_positions
from spec_engine.layers.sampler import derive_seed
from spec_engine.model_config import ModelConfig
from spec_engine.model_runner import ModelRunner, context_length
from spec_engine.outputs import Delivery, RequestOutput
from spec_engine.request import Req
from spec_engine.sampling_params import SamplingParams
from spec_engine.scheduler import Scheduler
from spec_engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

Prompt = Union[str, list[str], None]
InputIds = Union[list[int], list[list[int]], None]
Params = Union[dict[str, Any], list[dict[str, Any]], None]

_STOP = object()
_POLL_S = 1.0  # how often a waiting caller checks that the scheduler thread is alive


class _Channel:
    """Deliveries for one call's requests, put by the scheduler thread."""

    def __init__(self, alive: Callable[[], bool], loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        self._alive = alive
        self._loop = loop
        self._sync: queue.SimpleQueue = queue.SimpleQueue()
        self._async: Optional[asyncio.Queue] = asyncio.Queue() if loop is not None else None

    def put(self, item: Delivery) -> bool:
        """False when the caller's event loop is gone (nobody will read this)."""
        if self._loop is None:
            self._sync.put(item)
            return True
        try:
            self._loop.call_soon_threadsafe(self._async.put_nowait, item)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def get(self) -> Delivery:
        while True:
            try:
                return self._sync.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive()

    async def aget(self) -> Delivery:
        while True:
            try:
                return await asyncio.wait_for(self._async.get(), _POLL_S)
            except asyncio.TimeoutError:
                self._check_alive()

    def _check_alive(self) -> None:
        if not self._alive():
            raise RuntimeError("the engine's scheduler thread has stopped")


class Engine:
    """Generation engine: `Engine(model_path=..., **engine_args)`; see EngineArgs for options."""

    def __init__(self, engine_args: Optional[EngineArgs] = None, **kwargs: Any) -> None:
        args = dataclasses.replace(engine_args, **kwargs) if engine_args is not None else EngineArgs(**kwargs)
        logging.getLogger("spec_engine").setLevel(args.log_level.upper())
        if args.model_path is None:
            raise ValueError("model_path is required: a Hugging Face checkpoint directory")
        self.model_config = ModelConfig.from_pretrained(args.model_path)
        args = resolve_auto(args, cuda_available=torch.cuda.is_available(), checkpoint_dtype=self.model_config.torch_dtype)
        draft_path = args.speculative_draft_model_path
        draft_config = ModelConfig.from_pretrained(draft_path) if draft_path is not None else None
        self.args = resolve_speculative(args, self.model_config, draft_config, context_length(self.model_config, args))
        self.tokenizer = None if self.args.skip_tokenizer_init else load_tokenizer(self.args.tokenizer_path, self.args.chat_template)
        self.runner = ModelRunner(self.model_config, self.args, extra_positions=speculative_positions(self.args))
        self.context_len = self.runner.context_len
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        decode_tail = (lambda ids: self.tokenizer.decode(ids)) if self.tokenizer is not None else None
        self.scheduler = Scheduler(self.args, self.runner, frozenset(eos), decode_tail)
        self.weight_version = self.args.weight_version
        self._submitted = 0  # requests submitted so far: the default per-request seed index
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="spec-engine-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ generation

    def generate(self, prompt: Prompt = None, sampling_params: Params = None, input_ids: InputIds = None,
                 return_logprob: bool = False, top_logprobs_num: int = 0, stream: bool = False,
                 rid: Union[str, list[str], None] = None) -> Union[dict, list[dict], Iterator[dict]]:
        """Generate for one prompt (returns a dict) or a batch (a list, n samples per prompt in a row).

        With stream=True returns an iterator of cumulative output dicts (batch items carry "index").
        """
        reqs, single = self._make_requests(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                           rid, stream)
        channel = _Channel(self._thread.is_alive)
        outputs = self._submit(reqs, channel)
        if stream:
            return self._stream(outputs, single, channel)
        pending = len(outputs)
        while pending:
            delivery = channel.get()
            outputs[delivery.index].add(delivery)
            pending -= delivery.finished
        results = [o.to_dict() for o in outputs]
        return results[0] if single else results

    def _stream(self, outputs: list[RequestOutput], single: bool, channel: _Channel) -> Iterator[dict]:
        pending = len(outputs)
        try:
            while pending:
                delivery = channel.get()
                out = outputs[delivery.index]
                out.add(delivery)
                pending -= delivery.finished
                yield out.to_dict(None if single else delivery.index)
        finally:
            if pending:  # the caller stopped reading: stop the work
                self._abort_unfinished(outputs)

    async def async_generate(self, prompt: Prompt = None, sampling_params: Params = None, input_ids: InputIds = None,
                             return_logprob: bool = False, top_logprobs_num: int = 0, stream: bool = False,
                             rid: Union[str, list[str], None] = None) -> Union[dict, list[dict], AsyncIterator[dict]]:
        """Async form of `generate`; with stream=True returns an async iterator."""
        reqs, single = self._make_requests(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                           rid, stream)
        channel = _Channel(self._thread.is_alive, asyncio.get_running_loop())
        outputs = self._submit(reqs, channel)
        if stream:
            return self._astream(outputs, single, channel)
        pending = len(outputs)
        try:
            while pending:
                delivery = await channel.aget()
                outputs[delivery.index].add(delivery)
                pending -= delivery.finished
        finally:
            if pending:  # cancelled, e.g. an HTTP client went away: stop the work
                self._abort_unfinished(outputs)
        results = [o.to_dict() for o in outputs]
        return results[0] if single else results

    async def _astream(self, outputs: list[RequestOutput], single: bool, channel: _Channel) -> AsyncIterator[dict]:
        pending = len(outputs)
        try:
            while pending:
                delivery = await channel.aget()
                out = outputs[delivery.index]
                out.add(delivery)
                pending -= delivery.finished
                yield out.to_dict(None if single else delivery.index)
        finally:
            if pending:
                self._abort_unfinished(outputs)

    def _abort_unfinished(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if not out.finished:
                self.abort_request(out.req.rid)

    # ------------------------------------------------------------ control

    def abort_request(self, rid: str, message: str = "aborted by request") -> None:
        """Abort a request (or all n samples of one) by rid; it finishes with finish_reason abort."""
        if not self._closed:  # after shutdown every request has been aborted already
            self._post(lambda: self.scheduler.abort(rid, message))

    def flush_cache(self) -> bool:
        """Drop the prefix cache. Refused (False) while requests are queued or running."""
        return self._call(self.scheduler.flush_cache)

    def get_server_info(self) -> dict[str, Any]:
        """Engine options (without the API key), sizes, and the scheduler's current state."""
        args = {k: v for k, v in self.args.to_dict().items() if k != "api_key"}
        return {
            **args,
            "version": spec_engine.__version__,
            "context_length": self.context_len,
            "max_total_num_tokens": self.runner.max_total_tokens,
            "weight_version": self.weight_version,
            "internal_states": [self._call(self._internal_state)],
        }

    def _internal_state(self) -> dict[str, Any]:
        s = self.scheduler
        state = {
            "num_running_reqs": len(s.running),
            "num_waiting_reqs": len(s.waiting),
            "token_usage": round(1.0 - s.available_tokens() / s.allocator.total_tokens, 4),
            "num_retractions": s.num_retractions,
            "last_gen_throughput": s.last_gen_throughput,
        }
        if self.args.speculative_algorithm is not None:
            state["avg_spec_accept_length"] = s.spec_emitted / s.spec_verify_ct if s.spec_verify_ct else None
            state["spec_verify_ct"] = s.spec_verify_ct
            state["spec_time_breakdown"] = dict(s.worker.timings)
        return state

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.args.model_path,
            "tokenizer_path": None if self.tokenizer is None else self.args.tokenizer_path,
            "is_generation": True,
            "architecture": self.model_config.architecture,
            "weight_version": self.weight_version,
        }

    def shutdown(self) -> None:
        """Abort whatever is in flight and stop the scheduler thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(_STOP)
        self._thread.join(timeout=30)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------ requests

    def _make_requests(self, prompt: Prompt, input_ids: InputIds, sampling_params: Params, return_logprob: bool,
                       top_logprobs_num: int, rid: Union[str, list[str], None], stream: bool) -> tuple[list[Req], bool]:
        """Validate a call and expand it into requests (n per prompt); raises ValueError naming the field."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        ids_list, single = self._tokenize(prompt, input_ids)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(ids_list)} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(ids_list)
        if not isinstance(return_logprob, bool):
            raise ValueError(f"return_logprob must be true or false, got {return_logprob!r}")
        if (isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int)
                or not 0 <= top_logprobs_num <= self.model_config.vocab_size):
            raise ValueError(f"top_logprobs_num must be an integer in [0, vocab size], got {top_logprobs_num!r}")
        if not isinstance(stream, bool):
            raise ValueError(f"stream must be true or false, got {stream!r}")
        rids = self._rids(rid, len(ids_list))
        params = [self._check_request(ids, sp) for ids, sp in zip(ids_list, params)]
        reqs = []
        for ids, sp, base_rid in zip(ids_list, params, rids):
            for i in range(sp.n):
                if sp.sampling_seed is not None:
                    seed = derive_seed(sp.sampling_seed, i)
                else:
                    seed = derive_seed(self.args.random_seed, self._submitted)
                    self._submitted += 1
                reqs.append(Req(
                    rid=base_rid if sp.n == 1 else f"{base_rid}-{i}",
                    parent_rid=None if sp.n == 1 else base_rid,
                    origin_input_ids=list(ids),
                    sampling_params=sp,
                    seed=seed,
                    return_logprob=return_logprob,
                    # As in SGLang, top log-probs come only with return_logprob.
                    top_logprobs_num=top_logprobs_num if return_logprob else 0,
                    stream=stream,
                ))
        return reqs, single and len(reqs) == 1

    def _tokenize(self, prompt: Prompt, input_ids: InputIds) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) or input_ids")
        vocab = self.model_config.vocab_size
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer, but the engine runs with --skip-tokenizer-init; send input_ids")
            single = isinstance(prompt, str)
            prompts = [prompt] if single else prompt
            if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a non-empty list of strings")
            if any(p == "" for p in prompts):
                raise ValueError("prompt is empty; give at least one token of text")
            return [self.tokenizer(p)["input_ids"] for p in prompts], single
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        single = not isinstance(input_ids[0], list)
        batch = [input_ids] if single else input_ids
        for ids in batch:
            if not isinstance(ids, list) or not ids:
                raise ValueError("input_ids is empty; give at least one token id")
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"input_ids must hold integers, got {t!r}")
                if not 0 <= t < vocab:
                    raise ValueError(f"input_ids has token id {t}, outside the vocabulary [0, {vocab})")
        return batch, single

    def _check_request(self, ids: list[int], sp: SamplingParams) -> SamplingParams:
        """Refuse what the engine cannot serve; resolve max_new_tokens=None to what fits."""
        sp.check_vocab(self.model_config.vocab_size)
        if sp.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop (strings) needs a tokenizer, but the engine runs with "
                             "--skip-tokenizer-init; use stop_token_ids")
        n = len(ids)
        page = self.args.page_size
        # A decode step may hold draft tokens past the request's own sequence.
        pool = self.runner.max_total_tokens - self.scheduler.worker.decode_headroom()
        limit = min(self.context_len, pool // page * page)
        if n >= limit:
            raise ValueError(f"the prompt has {n} tokens, which does not fit the context length {self.context_len}"
                             f" / KV cache of {self.runner.max_total_tokens} tokens; shorten it")
        if sp.max_new_tokens is None:
            sp = dataclasses.replace(sp, max_new_tokens=limit - n)
        if n + sp.max_new_tokens > self.context_len:
            raise ValueError(f"max_new_tokens={sp.max_new_tokens} with a {n}-token prompt exceeds the context length "
                             f"{self.context_len}; lower max_new_tokens to at most {self.context_len - n}")
        need = -(-(n + sp.max_new_tokens) // page) * page
        if need > pool:
            raise ValueError(f"the request needs {need} KV tokens (plus {self.runner.max_total_tokens - pool} for "
                             f"speculative drafts) but the KV cache holds {self.runner.max_total_tokens}; "
                             "lower max_new_tokens, or raise --max-total-tokens / --mem-fraction-static")
        return sp

    def _rids(self, rid: Union[str, list[str], None], count: int) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        rids = [rid] if isinstance(rid, str) else rid
        if not isinstance(rids, list) or len(rids) != count or not all(isinstance(r, str) for r in rids):
            raise ValueError(f"rid must be a string per prompt ({count} expected), got {rid!r}")
        return rids

    def _submit(self, reqs: list[Req], channel: _Channel) -> list[RequestOutput]:
        for index, req in enumerate(reqs):
            req.on_output = self._make_callback(index, channel)

        def add() -> None:
            for req in reqs:
                self.scheduler.add_request(req)

        self._post(add)
        return [RequestOutput(req, self.tokenizer) for req in reqs]

    def _make_callback(self, index: int, channel: _Channel) -> Callable[[Req, bool], None]:
        def on_output(req: Req, finished: bool) -> None:
            delivered = channel.put(Delivery.of(index, req, finished, self.weight_version,
                                                self.args.speculative_algorithm is not None))
            if not delivered and not finished and not self._closed:
                self._post(lambda: self.scheduler.abort(req.rid, "the caller went away"))

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
        while True:
            try:
                if not self._run_commands():
                    return
                if self.scheduler.has_work():
                    self.scheduler.step()
            except Exception as e:
                logger.exception("engine step failed; failing the requests in flight")
                try:
                    self.scheduler.fail_all(f"engine error: {e!r}")
                except Exception:  # keep the thread alive: callers poll it
                    logger.exception("failing the requests in flight failed too")

    def _run_commands(self) -> bool:
        """Run queued commands (waiting for one when idle); False once shut down."""
        try:
            item = self._inbox.get(block=not self.scheduler.has_work())
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
