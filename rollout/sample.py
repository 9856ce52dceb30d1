"""Sample: one response to one prompt, the record the rollout hands to the trainer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional, Union

import torch


class Status(StrEnum):
    """Where a sample stands; the engine's finish_reason decides the final one."""

    PENDING = "PENDING"
    COMPLETED = "COMPLETED"  # finish_reason stop (EOS, stop token or stop string)
    TRUNCATED = "TRUNCATED"  # finish_reason length (hit max_new_tokens)
    ABORTED = "ABORTED"  # finish_reason abort (e.g. a leftover of over-sampling)
    FAILED = "FAILED"  # set by custom generate functions that could not produce a response

    @classmethod
    def from_finish_reason(cls, finish_reason: Optional[dict[str, Any]]) -> Status:
        kind = finish_reason.get("type") if isinstance(finish_reason, dict) else None
        if kind not in _FINISH_TYPES:
            raise ValueError(
                f"unknown finish_reason {finish_reason!r}; expected a dict with type stop, length "
                "or abort"
            )
        return _FINISH_TYPES[kind]


_FINISH_TYPES = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass
class Sample:
    """One prompt + response. `tokens` holds prompt and response ids; the response is the last
    `response_length` of them, and `loss_mask` / `rollout_log_probs` have one entry per
    response token. `spec_info` (speculative decoding only) holds the engine's per-request
    counters: spec_verify_ct, spec_accept_length, spec_accept_token_num, spec_draft_token_num,
    and spec_accept_alarm (1.0: the engine's acceptance alarm was up for its weights).
    `rollout_routed_experts` (--use-rollout-routing-replay): the engine's expert ids, int32
    [len(tokens) - 1, num_hidden_layers, top_k].

    `weight_versions` (slime's) holds the engine's weight version of every request that added to
    the response, in order; `token_weight_versions` the version of each response token (None
    when a custom generate function does not record it). A sample continued by
    --partial-rollout has several of each, and `metadata["start_rollout_id"]` (slime's) names
    the rollout it started in. `finish_time` (time.monotonic()) is when the response finished,
    set by the rollout that finished it (None in a later one: perf/rollout_tail_time)."""

    group_index: Optional[int] = None
    index: Optional[int] = None
    prompt: Union[str, list[dict[str, Any]]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: Optional[float] = None
    loss_mask: Optional[list[int]] = None
    rollout_log_probs: Optional[list[float]] = None
    rollout_routed_experts: Optional[torch.Tensor] = None
    status: Status = Status.PENDING
    weight_versions: list[str] = field(default_factory=list)
    token_weight_versions: Optional[list[str]] = None
    spec_info: Optional[dict[str, float]] = None
    finish_time: Optional[float] = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values only (status as its name), for torch.save / JSON."""
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown Sample fields {unknown}; known: {', '.join(sorted(known))}")
        values = dict(d)
        if "status" in values:
            values["status"] = Status(values["status"])
        return cls(**values)
