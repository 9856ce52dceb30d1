"""OpenAI-compatible request schemas and their mapping to SGLang sampling params."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    # Unknown fields are errors (400), never silently ignored.
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions, plus SGLang's extensions."""

    model: Optional[str] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    user: Optional[str] = None
    # SGLang extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    no_stop_trim: Optional[bool] = None
    rid: Optional[str] = None

    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    # Constrained decoding: SGLang's extra fields, and OpenAI's response_format.
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None
    # --enable-custom-logit-processor: SGLang's CustomLogitProcessor.to_str(), and its params.
    custom_logit_processor: Optional[str] = None
    custom_params: Optional[dict[str, Any]] = None

    def sampling_params(self, max_new_tokens: Optional[int]) -> dict[str, Any]:
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_new_tokens}")
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": self.n}
        for src, dst in (
            ("presence_penalty", "presence_penalty"),
            ("frequency_penalty", "frequency_penalty"),
            ("repetition_penalty", "repetition_penalty"),
            ("logit_bias", "logit_bias"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
            ("min_p", "min_p"),
            ("min_tokens", "min_new_tokens"),
            ("ignore_eos", "ignore_eos"),
            ("stop", "stop"),
            ("skip_special_tokens", "skip_special_tokens"),
            ("stop_token_ids", "stop_token_ids"),
            ("no_stop_trim", "no_stop_trim"),
            ("seed", "sampling_seed"),
            ("json_schema", "json_schema"),
            ("regex", "regex"),
            ("ebnf", "ebnf"),
            ("custom_params", "custom_params"),
        ):
            value = getattr(self, src)
            if value is not None:
                params[dst] = value
        if self.response_format is not None:
            params.update(response_format_params(self.response_format))
        return params


def response_format_params(fmt: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response_format as SGLang turns it into sampling params: json_object becomes
    the schema {"type": "object"}, json_schema its schema as JSON text."""
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError(
                'response_format of type json_schema needs {"json_schema": {"name": ..., '
                f'"schema": {{...}}}}}}, got {fmt!r:.200}'
            )
        return {"json_schema": json.dumps(spec["schema"])}
    raise ValueError(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema "
        "(structural_tag is not served by specrl)"
    )


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(
                    f"message content part of type {part.get('type')!r} is not supported; send "
                    "text parts"
                )
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class ScoringRequest(_Strict):
    """SGLang's /v1/score body (protocol.py ScoringRequest): the probability of each label token
    right after query + item, per item."""

    query: Optional[Union[str, list[int]]] = None
    items: Optional[Union[str, list[str], list[list[int]]]] = None
    label_token_ids: Optional[list[int]] = None
    apply_softmax: bool = False
    item_first: bool = False
    model: Optional[str] = None
    # SGLang fields specrl refuses at any other value (checked in score_api).
    return_pooled_hidden_states: bool = False
    embed_override_token_id: Optional[int] = None
    query_embed_overrides: Optional[list[list[float]]] = None
    item_embed_overrides: Optional[list[Optional[list[list[float]]]]] = None


class ResponseReasoning(_Strict):
    effort: Optional[str] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesRequest(_Strict):
    """SGLang's /v1/responses body (protocol.py ResponsesRequest), the fields a text model without
    tool or reasoning parsers can serve; what it cannot is refused in responses_api."""

    input: Union[str, list[dict[str, Any]]]
    model: Optional[str] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None  # accepted: usage is always in the last event
    store: bool = True
    background: bool = False
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    parallel_tool_calls: bool = True
    tool_choice: Union[Literal["auto", "required", "none"], dict[str, Any]] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[ResponseReasoning] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = 0
    truncation: Optional[Literal["auto", "disabled"]] = "disabled"
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    max_tool_calls: Optional[int] = None
    # SGLang's extensions
    request_id: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: Optional[Union[str, list[str]]] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    priority: int = 0
    session_id: Optional[str] = None
    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None
