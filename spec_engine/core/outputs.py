"""Request outputs: what the scheduler thread hands over, and the SGLang-style dicts built from
it."""

from __future__ import annotations

import base64
import logging
import math
import time
from array import array
from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers import PreTrainedTokenizerBase

from spec_engine.core.request import Req
from spec_engine.core.tokenizer import IncrementalDetokenizer, decode_text

logger = logging.getLogger(__name__)


class EngineFailure(RuntimeError):
    """The engine failed a request: HTTP `status_code` (500, or 503 for SGLang's request
    timeouts) with this message."""

    def __init__(self, message: str, status_code: int = 500) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass
class Delivery:
    """New output of one request since its last delivery (copied: the scheduler goes on)."""

    index: int
    new_ids: list[int]
    new_logprobs: Optional[list[float]]
    new_top_logprobs: Optional[list[list[tuple[float, int]]]]
    finished: bool
    finish_reason: Optional[dict[str, Any]]
    cached_tokens: int
    e2e_latency: float
    weight_version: str
    # (verify passes, tokens they emitted, draft tokens proposed) under speculative decoding.
    spec: Optional[tuple[int, int, int]] = None
    new_top_p_ids: Optional[list[list[int]]] = None
    # Prompt log-probs (complete once the prompt is prefilled) when asked for.
    input_logprobs: Optional[list[float]] = None
    input_top_logprobs: Optional[list[list[tuple[float, int]]]] = None
    input_token_ids_logprobs: Optional[list[list[float]]] = None
    # Whether the acceptance alarm (speculative.accept_alarm) is up for the weights that made it.
    accept_alarm: bool = False
    # With return_routed_experts, at the finish: [tokens, layers, top_k] int32 (Req's).
    routed_experts: Optional[torch.Tensor] = None
    # With token_ids_logprob: per new token, the log-probs of those ids.
    new_token_ids_logprobs: Optional[list[list[float]]] = None

    @classmethod
    def of(
        cls,
        index: int,
        req: Req,
        finished: bool,
        weight_version: str,
        speculative: bool = False,
        accept_alarm: bool = False,
    ) -> Delivery:
        start = req.delivered
        return cls(
            index=index,
            new_ids=req.output_ids[start:],
            new_logprobs=req.output_logprobs[start:] if req.input.return_logprob else None,
            new_top_logprobs=req.output_top_logprobs[start:]
            if req.input.top_logprobs_num
            else None,
            finished=finished,
            finish_reason=req.finished_reason if finished else None,
            cached_tokens=req.cached_tokens,
            e2e_latency=time.perf_counter() - req.input.created_time,
            weight_version=weight_version,
            spec=(req.spec_verify_ct, req.spec_emitted, req.spec_drafted) if speculative else None,
            new_top_p_ids=req.output_top_p_ids[start:] if req.output_top_p_ids else None,
            input_logprobs=list(req.input_logprobs) if req.wants_input_logprobs else None,
            input_top_logprobs=list(req.input_top_logprobs)
            if req.wants_input_logprobs and req.input.top_logprobs_num
            else None,
            input_token_ids_logprobs=list(req.input_token_ids_logprobs)
            if req.wants_input_logprobs and req.input.token_ids_logprob
            else None,
            accept_alarm=accept_alarm,
            routed_experts=req.routed_experts if finished else None,
            new_token_ids_logprobs=req.output_token_ids_logprobs[start:]
            if req.input.token_ids_logprob
            else None,
        )


class RequestOutput:
    """Everything a caller has received of one request; renders it as SGLang's output dict."""

    def __init__(self, req: Req, tokenizer: Optional[PreTrainedTokenizerBase]) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.token_ids_logprobs: list[list[float]] = []
        self.top_p_ids: list[list[int]] = []
        self.last: Optional[Delivery] = None
        sp = req.input.sampling_params
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer,
                req.input.origin_input_ids,
                sp.skip_special_tokens,
                sp.spaces_between_special_tokens,
            )
            if tokenizer is not None and req.input.stream
            else None
        )

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def add(self, delivery: Delivery) -> None:
        self.ids.extend(delivery.new_ids)
        if delivery.new_logprobs is not None:
            self.logprobs.extend(delivery.new_logprobs)
        if delivery.new_top_logprobs is not None:
            self.top_logprobs.extend(delivery.new_top_logprobs)
        if delivery.new_top_p_ids is not None:
            self.top_p_ids.extend(delivery.new_top_p_ids)
        if delivery.new_token_ids_logprobs is not None:
            self.token_ids_logprobs.extend(delivery.new_token_ids_logprobs)
        if self.detokenizer is not None and not delivery.finished:
            self.detokenizer.add(delivery.new_ids)
        self.last = delivery

    def to_dict(self, index: Optional[int] = None) -> dict[str, Any]:
        """The output so far (cumulative); raises if the engine failed the request."""
        self._check_failed()
        d = self.last
        meta: dict[str, Any] = {
            "id": self.req.input.rid,
            "finish_reason": d.finish_reason,
            "prompt_tokens": len(self.req.input.origin_input_ids),
            "completion_tokens": len(self.ids),
            "cached_tokens": d.cached_tokens,
            "e2e_latency": d.e2e_latency,
            "weight_version": d.weight_version,
        }
        if d.spec is not None:
            meta.update(_spec_meta(d.spec, d.accept_alarm))
        if self.req.input.return_logprob:
            meta.update(self._logprob_meta(d))
        if d.finish_reason is not None and self.top_p_ids:
            meta.update(self._top_p_meta())
        if d.routed_experts is not None:
            # SGLang's wire format (its detokenizer's): the int32 array's bytes in base64,
            # rows [routed_experts_start_len, prompt + output - 1), then layers, then top-k.
            meta["routed_experts"] = base64.b64encode(d.routed_experts.numpy().tobytes()).decode(
                "ascii"
            )
            meta["routed_experts_start_len"] = self.req.input.routed_experts_start_len
        out = {"text": self._text(), "output_ids": list(self.ids), "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out

    def _check_failed(self) -> None:
        """Raise EngineFailure when the engine failed the request or its log-probs are not
        finite."""
        fr = self.last.finish_reason
        if fr is not None and fr.get("status_code", 200) >= 500:
            if fr["status_code"] != 500:  # SGLang's timeouts: its message, its status code
                raise EngineFailure(fr["message"], fr["status_code"])
            raise EngineFailure(f"request {self.req.input.rid} failed: {fr['message']}")
        if not all(math.isfinite(lp) for lp in self.logprobs):
            logger.error("request %s: non-finite log-probs from the model", self.req.input.rid)
            raise EngineFailure(
                f"request {self.req.input.rid} failed: the model produced non-finite log-probs "
                "(NaN/Inf), so its tokens are meaningless; check the weights "
                "(--enable-nan-detection samples around NaN logits)"
            )

    def _logprob_meta(self, d: Delivery) -> dict[str, Any]:
        """SGLang's output_token_logprobs / output_top_logprobs: (logprob, id, None) entries,
        and the prompt's when asked for."""
        meta: dict[str, Any] = {
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(self.logprobs, self.ids)]
        }
        if self.req.input.top_logprobs_num:
            # A token a grammar or a custom processor forbids has log-prob -inf: null, as
            # SGLang's orjson writes it (JSON has no infinity).
            meta["output_top_logprobs"] = [
                [(lp if math.isfinite(lp) else None, t, None) for lp, t in top]
                for top in self.top_logprobs
            ]
        chosen = self.req.input.token_ids_logprob
        if chosen:  # SGLang's shape: per output position, (logprob, id, None) per asked id
            meta["output_token_ids_logprobs"] = [
                [(lp if math.isfinite(lp) else None, t, None) for lp, t in zip(values, chosen)]
                for values in self.token_ids_logprobs
            ]
        if d.input_logprobs is not None:
            meta.update(self._input_logprobs(d))
        return meta

    def _top_p_meta(self) -> dict[str, str]:
        """slime's top-p replay, as its SGLang patch sends it (only with the finish reason):
        every nucleus's token ids in one array, and where each starts."""
        flat, offsets = [], [0]
        for nucleus in self.top_p_ids:
            flat.extend(nucleus)
            offsets.append(len(flat))
        return {"top_p_token_ids": _b64_int32(flat), "top_p_token_offsets": _b64_int32(offsets)}

    def _input_logprobs(self, d: Delivery) -> dict[str, Any]:
        """SGLang's input_token_logprobs: (logprob, id, None) for every prompt token from
        logprob_start_len on, the first entry's logprob None (SGLang pads it whatever the
        start)."""
        ids = self.req.input.origin_input_ids[self.req.input.logprob_start_len :]
        logprobs = [None, *d.input_logprobs]
        out: dict[str, Any] = {
            "input_token_logprobs": [
                (logprobs[k] if k < len(logprobs) else None, t, None) for k, t in enumerate(ids)
            ]
        }
        if d.input_top_logprobs is not None:
            tops = [None, *d.input_top_logprobs]
            out["input_top_logprobs"] = [
                None if k >= len(tops) or tops[k] is None else [(lp, t, None) for lp, t in tops[k]]
                for k in range(len(ids))
            ]
        if d.input_token_ids_logprobs is not None:  # the same shape, the asked ids in order
            chosen = self.req.input.token_ids_logprob
            rows = [None, *d.input_token_ids_logprobs]
            out["input_token_ids_logprobs"] = [
                None
                if k >= len(rows) or rows[k] is None
                else [(lp, t, None) for lp, t in zip(rows[k], chosen)]
                for k in range(len(ids))
            ]
        return out

    def _text(self) -> Optional[str]:
        if self.tokenizer is None:
            return None
        sp = self.req.input.sampling_params
        if not self.finished:
            return (
                _hold_back_stop_prefix(self.detokenizer.text, sp.stop) if self.detokenizer else None
            )
        fr = self.last.finish_reason
        matched = fr.get("matched") if fr else None
        trim = not sp.no_stop_trim and fr is not None and fr["type"] == "stop"
        ids = self.ids[:-1] if trim and isinstance(matched, int) else self.ids
        text = decode_text(
            self.tokenizer, ids, sp.skip_special_tokens, sp.spaces_between_special_tokens
        )
        if trim and isinstance(matched, str):
            pos = text.find(matched)
            if pos >= 0:
                text = text[:pos]
        return text


def _spec_meta(spec: tuple[int, int, int], accept_alarm: bool) -> dict[str, Any]:
    """SGLang's speculative counters from (verify passes, tokens emitted, drafts proposed)."""
    verify_ct, emitted, drafted = spec
    accepted = emitted - verify_ct
    return {
        "spec_verify_ct": verify_ct,
        # SGLang's count: tokens per verify pass, accepted drafts plus the bonus token.
        "spec_accept_length": emitted / verify_ct if verify_ct else 0.0,
        "spec_accept_token_num": accepted,
        "spec_draft_token_num": drafted,
        "spec_accept_rate": accepted / drafted if drafted else 0.0,
        # specrl's: acceptance collapsed after a weight update (speculative.accept_alarm).
        "spec_accept_alarm": accept_alarm,
    }


def _hold_back_stop_prefix(text: str, stops: Optional[list[str]]) -> str:
    """Drop a tail that could be the start of a stop string, so a stream never shows text the
    final output will trim."""
    cut = 0
    for stop in stops or []:
        for k in range(min(len(stop) - 1, len(text)), cut, -1):
            if text.endswith(stop[:k]):
                cut = k
                break
    return text[: len(text) - cut]


def _b64_int32(values: list[int]) -> str:
    """Little-endian int32, base64: how slime decodes its top-p arrays."""
    return base64.b64encode(array("i", values).tobytes()).decode("ascii")
