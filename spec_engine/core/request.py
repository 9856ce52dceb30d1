"""Req: one generation request as the scheduler tracks it, from admission to finish: its fixed
input (ReqInput) and the state that changes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from spec_engine.core.sampling_params import SamplingParams

# How many trailing tokens are decoded to look for a stop string, beyond its length in chars:
# a token decodes to at least one character except for partial UTF-8 sequences.
_STOP_TAIL_EXTRA_TOKENS = 4


@dataclass(frozen=True)
class ReqInput:
    """A request as it arrives: nothing changes it afterwards."""

    rid: str
    origin_input_ids: tuple[int, ...]
    sampling_params: SamplingParams  # max_new_tokens resolved (see RequestBuilder)
    seed: int
    # The rid the caller used when this request is one of its n samples.
    parent_rid: Optional[str] = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # With return_logprob: the ids whose log-probs each output position reports.
    token_ids_logprob: tuple[int, ...] = ()
    # With return_logprob: the prompt position from which input_token_logprobs are reported
    # (-1: none, SGLang's default for generation).
    logprob_start_len: int = -1
    stream: bool = False
    # Routing replay (--enable-return-routed-experts): report each token's experts from
    # this position on (SGLang's routed_experts_start_len).
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # --enable-custom-logit-processor: SGLang's CustomLogitProcessor.to_str() of the processor
    # this request's logits go through (core.custom_logit_processor).
    custom_logit_processor: Optional[str] = None
    created_time: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class Req:
    """A request in the scheduler: its fixed `input`, and what the scheduler and the worker
    change."""

    input: ReqInput
    # Set by the engine before submission: called from the scheduler thread with (req, finished)
    # when there is output to deliver; `delivered` counts the output tokens handed over so far.
    on_output: Optional[Callable[[Req, bool], None]] = None
    delivered: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # Per output position, the log-probs of input.token_ids_logprob.
    output_token_ids_logprobs: list[list[float]] = field(default_factory=list)
    # slime's top-p replay: each output token's nucleus (core.logits_processor.top_p_replay).
    output_top_p_ids: list[list[int]] = field(default_factory=list)
    # With input log-probs asked for from prompt position s (logprob_start_len): the log-probs
    # of prompt tokens s + 1, s + 2, ... (token s gets none, as in SGLang), filled by prefill.
    input_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[float]] = field(default_factory=list)
    finished_reason: Optional[dict[str, Any]] = None
    # When it last entered the waiting queue and when it first ran (perf_counter; 0: not yet):
    # what SGLang's request timeouts measure (core.timeouts).
    wait_queue_entry_time: float = 0.0
    forward_entry_time: float = 0.0
    # With return_routed_experts, set at the finish: [tokens, layers, top_k] int32 on the CPU.
    routed_experts: Optional[torch.Tensor] = None
    # KV state: positions [0, kv_len) have KV at req_to_token[req_pool_idx, :kv_len];
    # [0, prefix_len) of those belong to the prefix cache, locked through last_node.
    req_pool_idx: Optional[int] = None
    kv_len: int = 0
    prefix_len: int = 0
    last_node: Any = None
    # The scheduler's weight epoch when this request's KV was computed (stale KV is not cached).
    kv_epoch: int = 0
    cached_tokens: int = 0
    # Tokens this request still has to prefill before it can decode (chunked prefill).
    extend_len: int = 0
    retractions: int = 0
    # Speculative decoding: the worker's per-request state (draft top-k and features, or n-gram
    # cursors) and counters (verify passes, tokens they emitted, draft tokens proposed).
    spec_state: Any = None
    spec_verify_ct: int = 0
    spec_emitted: int = 0
    spec_drafted: int = 0
    # Decoded without speculation (acceptance alarm, --speculative-on-collapse disable): the
    # draft's KV and state lag behind its tokens, so it decodes plainly until it finishes or a
    # retraction's prefill rebuilds them (speculative/policy.py).
    draft_stale: bool = False
    # --speculative-adaptive with a draft model: the draft's inputs at the positions decoded
    # plainly since its KV was last in step, for the next speculative step to catch up on
    # (speculative/draft_lag.py); None when the draft is in step.
    draft_lag: Any = None
    # Constrained decoding: the request's grammar matcher (constrained.grammar.Grammar), which
    # has accepted every output token so far; None without regex / json_schema / ebnf.
    grammar: Any = None

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs: the prompt, then what it generated."""
        return [*self.input.origin_input_ids, *self.output_ids]

    @property
    def seq_len(self) -> int:
        return len(self.input.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.input.return_logprob and self.input.logprob_start_len >= 0

    def positions_to_score(self) -> range:
        """Prompt positions whose logits are still to be scored (position q's logits give the
        log-prob of prompt token q + 1): the prefill must compute these, not take their KV
        from the prefix cache."""
        if not self.wants_input_logprobs:
            return range(0)
        first = self.input.logprob_start_len + len(self.input_logprobs)
        return range(first, len(self.input.origin_input_ids) - 1)

    def max_new_tokens(self) -> int:
        assert self.input.sampling_params.max_new_tokens is not None, (
            "max_new_tokens is resolved at admission"
        )
        return self.input.sampling_params.max_new_tokens

    def banned_tokens(self, eos_token_ids: frozenset[int], ahead: int = 0) -> list[int]:
        """Tokens that may not be emitted `ahead` tokens from now: EOS and stop ids before
        min_new_tokens."""
        sp = self.input.sampling_params
        if len(self.output_ids) + ahead >= sp.min_new_tokens or sp.ignore_eos:
            return []
        return sorted(eos_token_ids.union(sp.stop_token_ids or ()))

    def check_finished(
        self, eos_token_ids: frozenset[int], decode_tail: Optional[Callable[[list[int]], str]]
    ) -> None:
        """Set finished_reason if the last emitted token ends the request (SGLang's rules)."""
        if self.finished_reason is not None:
            return
        sp = self.input.sampling_params
        n_out = len(self.output_ids)
        if n_out >= self.max_new_tokens():
            self.finished_reason = {"type": "length", "length": n_out}
            return
        if self.grammar is not None and self.grammar.is_terminated():
            # As in SGLang: the grammar accepted a stop token, the output is complete.
            self.finished_reason = {"type": "stop", "matched": self.output_ids[-1]}
            return
        if n_out < sp.min_new_tokens:
            return
        last = self.output_ids[-1]
        # As in SGLang, ignore_eos also ignores stop_token_ids.
        if not sp.ignore_eos and (
            last in eos_token_ids or (sp.stop_token_ids and last in sp.stop_token_ids)
        ):
            self.finished_reason = {"type": "stop", "matched": last}
            return
        if sp.stop and decode_tail is not None:
            longest = max(len(s) for s in sp.stop)
            tail = decode_tail(self.output_ids[-(longest + _STOP_TAIL_EXTRA_TOKENS) :])
            for stop in sp.stop:
                if stop in tail:
                    self.finished_reason = {"type": "stop", "matched": stop}
                    return
