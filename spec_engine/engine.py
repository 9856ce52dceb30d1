"""Engine: the in-process API, mirroring sglang.Engine.

The scheduler runs in one background thread; every call from the outside (generate, abort,
flush) is posted to it through a queue, and outputs come back through per-call channels, so
the sync API, the async API and the HTTP server share one code path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Union

import torch

import spec_engine
from spec_engine.config import EngineArgs, resolve_auto
from spec_engine.layers.sampler import derive_seed
from spec_engine.model_config import ModelConfig
from spec_engine.model_runner import ModelRunner
from spec_engine.request import Req
from spec_engine.sampling_params import SamplingParams
from spec_engine.scheduler import Scheduler
from spec_engine.tokenizer import decode_text, load_tokenizer

logger = logging.getLogger(__name__)

Prompt = Union[str, list[str], None]
InputIds = Union[list[int], list[list[int]], None]
Params = Union[dict[str, Any], list[dict[str, Any]], None]

_STOP = object()


class _Channel:
    """Outputs of one call's requests: (index, snapshot) items, from the scheduler thread."""

    def __init__(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        self._loop = loop
        self._sync: queue.SimpleQueue = queue.SimpleQueue()
        self._async: Optional[asyncio.Queue] = asyncio.Queue() if loop is not None else None

    def put(self, item: tuple[int, dict[str, Any]]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._async.put_nowait, item)
        else:
            self._sync.put(item)

    def get(self) -> tuple[int, dict[str, Any]]:
        return self._sync.get()

    async def aget(self) -> tuple[int, dict[str, Any]]:
        return await self._async.get()


class Engine:
    """Generation engine: `Engine(model_path=..., **engine_args)`; see EngineArgs for options."""

    def __init__(self, engine_args: Optional[EngineArgs] = None, **kwargs: Any) -> None:
        args = dataclasses.replace(engine_args, **kwargs) if engine_args is not None else EngineArgs(**kwargs)
        logging.getLogger("spec_engine").setLevel(args.log_level.upper())
        if args.model_path is None:
            raise ValueError("model_path is required: a Hugging Face checkpoint directory")
        self.model_config = ModelConfig.from_pretrained(args.model_path)
        self.args = resolve_auto(args, cuda_available=torch.cuda.is_available(),
                                 checkpoint_dtype=self.model_config.torch_dtype)
        self.tokenizer = None if self.args.skip_tokenizer_init else load_tokenizer(self.args.tokenizer_path, self.args.chat_template)
        self.runner = ModelRunner(self.model_config, self.args)
        self.context_len = self.runner.context_len
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        decode_tail = (lambda ids: self.tokenizer.decode(ids)) if self.tokenizer is not None else None
        self.scheduler = Scheduler(self.args, self.runner, frozenset(eos), decode_tail)
        self.weight_version = self.args.weight_version
        self._req_counter = itertools.count()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
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
        reqs, single = self._make_requests(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, rid)
        channel = _Channel()
        self._submit(reqs, channel)
        if stream:
            return self._stream(reqs, single, channel)
        finals: list[Optional[dict]] = [None] * len(reqs)
        for _ in range(len(reqs)):
            while True:
                index, snap = channel.get()
                if snap["finished"]:
                    break
            finals[index] = self._format(reqs[index], snap)
        return finals[0] if single else finals

    def _stream(self, reqs: list[Req], single: bool, channel: _Channel) -> Iterator[dict]:
        remaining = len(reqs)
        while remaining:
            index, snap = channel.get()
            remaining -= snap["finished"]
            yield self._format(reqs[index], snap, index=None if single else index)

    async def async_generate(self, prompt: Prompt = None, sampling_params: Params = None, input_ids: InputIds = None,
                             return_logprob: bool = False, top_logprobs_num: int = 0, stream: bool = False,
                             rid: Union[str, list[str], None] = None) -> Union[dict, list[dict], AsyncIterator[dict]]:
        """Async form of `generate`; with stream=True returns an async iterator."""
        reqs, single = self._make_requests(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, rid)
        channel = _Channel(asyncio.get_running_loop())
        self._submit(reqs, channel)
        if stream:
            return self._astream(reqs, single, channel)
        finals: list[Optional[dict]] = [None] * len(reqs)
        try:
            for _ in range(len(reqs)):
                while True:
                    index, snap = await channel.aget()
                    if snap["finished"]:
                        break
                finals[index] = self._format(reqs[index], snap)
        except asyncio.CancelledError:
            # The caller went away (e.g. an HTTP client disconnected): stop the work.
            for r in reqs:
                self.abort_request(r.rid)
            raise
        return finals[0] if single else finals

    async def _astream(self, reqs: list[Req], single: bool, channel: _Channel) -> AsyncIterator[dict]:
        remaining = len(reqs)
        try:
            while remaining:
                index, snap = await channel.aget()
                remaining -= snap["finished"]
                yield self._format(reqs[index], snap, index=None if single else index)
        finally:
            if remaining:
                for r in reqs:
                    self.abort_request(r.rid)

    # ------------------------------------------------------------ control

    def abort_request(self, rid: str) -> None:
        """Abort a request (or all n samples of one) by rid; it finishes with finish_reason abort."""
        self._post(lambda: self.scheduler.abort(rid))

    def flush_cache(self) -> bool:
        """Drop the prefix cache. Refused (False) while requests are queued or running."""
        return self._call(self.scheduler.flush_cache)

    def get_server_info(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            **self.args.to_dict(),
            "version": spec_engine.__version__,
            "context_length": self.context_len,
            "max_total_num_tokens": self.runner.max_total_tokens,
            "weight_version": self.weight_version,
            "internal_states": [{
                "num_running_reqs": len(s.running),
                "num_waiting_reqs": len(s.waiting),
                "token_usage": round(1.0 - s.available_tokens() / s.allocator.total_tokens, 4),
                "num_retractions": s.num_retractions,
                "last_gen_throughput": s.last_gen_throughput,
            }],
        }

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.args.model_path,
            "tokenizer_path": None if self.tokenizer is None else self.args.tokenizer_path,
            "is_generation": True,
            "architecture": self.model_config.architecture,
            "weight_version": self.weight_version,
        }

    def shutdown(self) -> None:
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
                       top_logprobs_num: int, rid: Union[str, list[str], None]) -> tuple[list[Req], bool]:
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
        if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= self.model_config.vocab_size:
            raise ValueError(f"top_logprobs_num must be an integer in [0, vocab size], got {top_logprobs_num!r}")
        rids = self._rids(rid, len(ids_list))
        reqs = []
        for ids, sp, base_rid in zip(ids_list, params, rids):
            sp = self._check_lengths(ids, sp)
            for i in range(sp.n):
                seed_base = sp.sampling_seed if sp.sampling_seed is not None else self.args.random_seed
                seed_index = i if sp.sampling_seed is not None else next(self._req_counter)
                reqs.append(Req(
                    rid=base_rid if sp.n == 1 else f"{base_rid}-{i}",
                    parent_rid=None if sp.n == 1 else base_rid,
                    origin_input_ids=list(ids),
                    sampling_params=sp,
                    seed=derive_seed(seed_base, seed_index),
                    return_logprob=return_logprob,
                    top_logprobs_num=top_logprobs_num,
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

    def _check_lengths(self, ids: list[int], sp: SamplingParams) -> SamplingParams:
        sp.check_vocab(self.model_config.vocab_size)
        n = len(ids)
        if n >= self.context_len:
            raise ValueError(f"the prompt has {n} tokens, which does not fit the context length {self.context_len}; shorten it")
        if sp.max_new_tokens is None:
            sp = dataclasses.replace(sp, max_new_tokens=self.context_len - n)
        if n + sp.max_new_tokens > self.context_len:
            raise ValueError(f"max_new_tokens={sp.max_new_tokens} with a {n}-token prompt exceeds the context length "
                             f"{self.context_len}; lower max_new_tokens to at most {self.context_len - n}")
        page = self.args.page_size
        need = -(-(n + sp.max_new_tokens) // page) * page
        if need > self.runner.max_total_tokens:
            raise ValueError(f"the request needs {need} KV tokens but the KV cache holds {self.runner.max_total_tokens}; "
                             "lower max_new_tokens, or raise --max-total-tokens / --mem-fraction-static")
        return sp

    def _rids(self, rid: Union[str, list[str], None], count: int) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        rids = [rid] if isinstance(rid, str) else rid
        if not isinstance(rids, list) or len(rids) != count or not all(isinstance(r, str) for r in rids):
            raise ValueError(f"rid must be a string per prompt ({count} expected), got {rid!r}")
        return rids

    def _submit(self, reqs: list[Req], channel: _Channel) -> None:
        for index, req in enumerate(reqs):
            req.on_output = self._make_callback(index, channel)

        def add() -> None:
            for req in reqs:
                self.scheduler.add_request(req)

        self._post(add)

    def _make_callback(self, index: int, channel: _Channel) -> Callable[[Req, bool], None]:
        def on_output(req: Req, finished: bool) -> None:
            channel.put((index, self._snapshot(req, finished)))

        return on_output

    def _snapshot(self, req: Req, finished: bool) -> dict[str, Any]:
        """What a consumer needs of a request at this moment (copied: the scheduler goes on)."""
        return {
            "finished": finished,
            "output_ids": list(req.output_ids),
            "logprobs": list(req.output_logprobs) if req.return_logprob else None,
            "top_logprobs": list(req.output_top_logprobs) if req.top_logprobs_num else None,
            "finish_reason": req.finished_reason if finished else None,
            "cached_tokens": req.cached_tokens,
            "e2e_latency": time.perf_counter() - req.created_time,
            "weight_version": self.weight_version,
        }

    def _format(self, req: Req, snap: dict[str, Any], index: Optional[int] = None) -> dict[str, Any]:
        """An SGLang-style output dict."""
        fr = snap["finish_reason"]
        if fr is not None and fr.get("status_code", 200) >= 500:
            raise RuntimeError(f"request {req.rid} failed: {fr['message']}")
        ids = snap["output_ids"]
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": fr,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": snap["cached_tokens"],
            "e2e_latency": snap["e2e_latency"],
            "weight_version": snap["weight_version"],
        }
        if snap["logprobs"] is not None:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(snap["logprobs"], ids)]
        if snap["top_logprobs"] is not None:
            meta["output_top_logprobs"] = [[(lp, t, None) for lp, t in top] for top in snap["top_logprobs"]]
        out = {"text": self._text(req, ids, fr, partial=not snap["finished"]), "output_ids": ids, "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out

    def _text(self, req: Req, ids: list[int], finish_reason: Optional[dict], partial: bool) -> Optional[str]:
        if self.tokenizer is None:
            return None
        sp = req.sampling_params
        matched = (finish_reason or {}).get("matched")
        trim = not sp.no_stop_trim and finish_reason is not None and finish_reason["type"] == "stop"
        if trim and isinstance(matched, int):
            ids = ids[:-1]
        text = decode_text(self.tokenizer, ids, sp.skip_special_tokens, sp.spaces_between_special_tokens, partial)
        if trim and isinstance(matched, str):
            pos = text.find(matched)
            if pos >= 0:
                text = text[:pos]
        return text

    # ------------------------------------------------------------ scheduler thread

    def _post(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((fn, future))
        return future

    def _call(self, fn: Callable[[], Any]) -> Any:
        if self._closed:
            raise RuntimeError("engine is shut down")
        return self._post(fn).result()

    def _loop(self) -> None:
        while True:
            try:
                item = self._inbox.get(block=not self.scheduler.has_work())
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    self.scheduler.abort_all("engine shut down")
                    return
                fn, future = item
                try:
                    future.set_result(fn())
                except Exception as e:  # handed to the caller through the future
                    future.set_exception(e)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if self.scheduler.has_work():
                try:
                    self.scheduler.step()
                except Exception as e:
                    logger.exception("engine step failed; failing the requests in flight")
                    self.scheduler.fail_all(f"engine error: {e!r}")
