"""SamplingParams: SGLang's per-request sampling keys, parsed strictly and validated."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

# SGLang keys specrl does not implement; accepted only at their neutral value so a client
# that always sends them still works, refused otherwise (never silently ignored).
_NEUTRAL_UNSUPPORTED = {
    "structural_tag": (
        None,
        "structural tags are not supported by specrl; constrain with json_schema, regex or ebnf",
    ),
    "stop_regex": (None, "stop strings are matched literally; use stop"),
}


# Temperatures below this decode greedily (SGLang's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-6


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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[str, float]] = None
    # For SGLang's custom logit processors; specrl has none, and acts on slime's
    # {"return_top_p_token_ids": true} only (core.logits_processor.top_p_replay).
    custom_params: Optional[dict[str, Any]] = None
    # Constrained decoding (spec_engine.constrained): at most one, each a string as in SGLang.
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None

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
                neutral, why = _NEUTRAL_UNSUPPORTED[key]
                if value != neutral:
                    raise ValueError(f"sampling_params.{key}: {why}")
            else:
                raise ValueError(
                    f"unknown sampling parameter {key!r}; supported: {', '.join(sorted(known))}"
                )
        sp = cls(**kwargs)
        sp.validate()
        return sp

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (a lone stop string becomes a list)."""
        self._check_numbers()
        self._check_penalties()
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
        self._check_stops()
        self._check_grammar()

    def _check_grammar(self) -> None:
        for name in ("json_schema", "regex", "ebnf"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(
                    f"sampling_params.{name} must be a string (a JSON schema as JSON text, for "
                    f"json_schema), got {value!r:.100}"
                )
        grammars = sum(getattr(self, n) is not None for n in ("json_schema", "regex", "ebnf"))
        if grammars > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
        if grammars and self.min_new_tokens:
            # Banning EOS could leave a grammar that must end now no token at all.
            raise ValueError(
                f"sampling_params.min_new_tokens ({self.min_new_tokens}) cannot be combined with "
                "regex, json_schema or ebnf: the grammar decides where the output ends; leave "
                "min_new_tokens at 0"
            )

    def _check_numbers(self) -> None:
        """Token counts, the seed and the sampling knobs: types and ranges."""
        # 0: prefill only, to score the prompt (input_token_logprobs), as SGLang allows.
        _int("max_new_tokens", self.max_new_tokens, minimum=0, allow_none=True)
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

    def _check_penalties(self) -> None:
        """The penalties, logit_bias and custom_params (what changes the logits)."""
        for name in ("frequency_penalty", "presence_penalty"):
            _number(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(
                    f"sampling_params.{name} must be in [-2, 2], got {getattr(self, name)}"
                )
        _number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                "sampling_params.repetition_penalty must be in (0, 2] (1 = off), got "
                f"{self.repetition_penalty}"
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                isinstance(k, str) and k.lstrip("-").isdigit() for k in self.logit_bias
            ):
                raise ValueError(
                    "sampling_params.logit_bias must map token ids (as strings) to numbers, got "
                    f"{self.logit_bias!r:.100}"
                )
            for value in self.logit_bias.values():
                _number("logit_bias value", value)
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            raise ValueError(
                f"sampling_params.custom_params must be an object, got {self.custom_params!r:.100}"
            )

    def _check_stops(self) -> None:
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
        for t in self.logit_bias or {}:
            if not 0 <= int(t) < vocab_size:
                raise ValueError(
                    f"sampling_params.logit_bias has token {t}, outside the vocabulary [0, "
                    f"{vocab_size})"
                )
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab_size:
                raise ValueError(
                    f"sampling_params.stop_token_ids has {t}, outside the vocabulary [0, "
                    f"{vocab_size})"
                )

    @property
    def changes_logits(self) -> bool:
        """A penalty or a logit bias applies (core.logits_processor)."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def is_greedy(self) -> bool:
        """Greedy: temperature below SGLang's epsilon (any smaller one would overflow the
        division; SGLang decodes it greedily too), or top_k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def logit_scale(self) -> float:
        """What logits are divided by: the temperature, or 1 where it is greedy (log-probs of
        greedy requests are those of the unscaled distribution, as in SGLang)."""
        return self.temperature if self.temperature >= GREEDY_TEMPERATURE else 1.0

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
