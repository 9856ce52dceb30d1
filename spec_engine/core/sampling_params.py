"""SamplingParams: SGLang's per-request sampling keys, parsed strictly and validated."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

# SGLang keys specrl does not implement; accepted only at their neutral value so a client
# that always sends them still works, refused otherwise (never silently ignored).
_NEUTRAL_UNSUPPORTED = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "logit_bias": None,
    "custom_params": None,
}


@dataclass
class SamplingParams:
    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: Optional[int] = None

    @classmethod
    def from_dict(cls, params: Optional[dict[str, Any]]) -> SamplingParams:
        """Parse a request's sampling_params dict; unknown keys and bad values raise ValueError."""
        if params is None:
            return cls()
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be an object, got {type(params).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in params.items():
            if key in known:
                kwargs[key] = value
            elif key in _NEUTRAL_UNSUPPORTED:
                if value not in (None, _NEUTRAL_UNSUPPORTED[key]):
                    raise ValueError(
                        f"sampling_params.{key} is not supported by specrl (only "
                        f"{_NEUTRAL_UNSUPPORTED[key]!r} is accepted)"
                    )
            else:
                raise ValueError(
                    f"unknown sampling parameter {key!r}; supported: {', '.join(sorted(known))}"
                )
        sp = cls(**kwargs)
        sp.validate()
        return sp

    def validate(self) -> None:
        _int("max_new_tokens", self.max_new_tokens, minimum=1, allow_none=True)
        _int("min_new_tokens", self.min_new_tokens, minimum=0)
        _int("n", self.n, minimum=1)
        _int("sampling_seed", self.sampling_seed, minimum=0, allow_none=True)
        _number("temperature", self.temperature)
        _number("top_p", self.top_p)
        _number("min_p", self.min_p)
        _int("top_k", self.top_k, minimum=-1)
        if self.temperature < 0:
            raise ValueError(
                f"sampling_params.temperature must be >= 0 (0 means greedy), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0:
            raise ValueError("sampling_params.top_k must be -1 (disabled) or >= 1, got 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling_params.min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"sampling_params.min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "no_stop_trim",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"sampling_params.{name} must be true or false, got {getattr(self, name)!r}"
                )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(
                isinstance(s, str) and s for s in self.stop
            ):
                raise ValueError(
                    "sampling_params.stop must be a non-empty string or a list of them, got "
                    f"{self.stop!r}"
                )
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list) or not all(
                _is_int(t) for t in self.stop_token_ids
            ):
                raise ValueError(
                    "sampling_params.stop_token_ids must be a list of token ids, got "
                    f"{self.stop_token_ids!r}"
                )

    def check_vocab(self, vocab_size: int) -> None:
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab_size:
                raise ValueError(
                    f"sampling_params.stop_token_ids has {t}, outside the vocabulary [0, "
                    f"{vocab_size})"
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value):
        raise ValueError(f"sampling_params.{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"sampling_params.{name} must be >= {minimum}, got {value}")


def _number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"sampling_params.{name} must be a finite number, got {value!r}")
