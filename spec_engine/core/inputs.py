"""Turning a generate call into validated requests: tokenize, check limits, assign seeds."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from typing import Any, Optional, Union

from transformers import PreTrainedTokenizerBase

from spec_engine.constrained.grammar import GrammarBackend, grammar_key
from spec_engine.core.custom_logit_processor import DISABLED, check_processor
from spec_engine.core.request import Req, ReqInput
from spec_engine.core.sampling_params import SamplingParams
from spec_engine.layers.sampler import derive_seed

Prompt = Union[str, list[str], None]
InputIds = Union[list[int], list[list[int]], None]
Params = Union[dict[str, Any], list[dict[str, Any]], None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateReqInput:
    """One generate call, built once by Engine.generate/async_generate: SGLang's
    io_struct.GenerateReqInput, with the fields specrl serves (same names; text is the
    engine's `prompt`). A field may hold one value for a single prompt, or (the log-prob
    fields, rid, sampling_params) a list with one per prompt of a batch; RequestBuilder.build
    checks them."""

    text: Prompt = None
    input_ids: InputIds = None
    sampling_params: Params = None
    rid: Union[str, list[str], None] = None
    return_logprob: Union[bool, list[bool]] = False
    # With return_logprob: the prompt position input_token_logprobs start at (-1: none).
    logprob_start_len: Union[int, list[int]] = -1
    top_logprobs_num: Union[int, list[int]] = 0
    # With return_logprob: the ids whose log-probs each output position reports (SGLang's
    # meta_info.output_token_ids_logprobs); one list for every prompt, or a list per prompt.
    token_ids_logprob: Union[list[int], list[list[int]], None] = None
    stream: bool = False
    # Routing replay (MoE, --enable-return-routed-experts): meta_info.routed_experts from
    # routed_experts_start_len on.
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # SGLang's CustomLogitProcessor.to_str(), one for every prompt or one per prompt.
    custom_logit_processor: Union[str, list[Optional[str]], None] = None


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one call may ask for (--max-request-prompts/-samples/-tokens): a client cannot
    take the whole engine with one request."""

    prompts: int = 4096
    samples: int = 16384
    tokens: int = 2**24

    def check(self, ids_list: list[list[int]], params: list[SamplingParams]) -> None:
        samples = sum(sp.n for sp in params)
        tokens = sum(sp.n * (len(ids) + sp.max_new_tokens) for ids, sp in zip(ids_list, params))
        for what, count, limit, flag in (
            ("prompts", len(ids_list), self.prompts, "--max-request-prompts"),
            ("samples (prompts x n)", samples, self.samples, "--max-request-samples"),
            (
                "tokens (prompt + max_new_tokens per sample)",
                tokens,
                self.tokens,
                "--max-request-tokens",
            ),
        ):
            if count > limit:
                raise ValueError(
                    f"the request has {count} {what}, above the server's limit of {limit} "
                    f"({flag}); split it into smaller requests"
                )


def routing_refusal(moe: bool, enabled: bool) -> Optional[str]:
    """Why requests may not ask for routed experts, naming the fix (None: they may)."""
    if not moe:
        return (
            "the model has no MoE layers to report routed experts for (routing replay needs a "
            "MoE model such as GLM-4.5); leave it out"
        )
    if not enabled:
        return (
            "start the engine with --enable-return-routed-experts (slime's "
            "--use-rollout-routing-replay sets it) to return routed experts"
        )
    return None


class RequestBuilder:
    """Checks what the engine can serve and builds its Req records (n per prompt).

    `kv_tokens` is the KV pool size; `kv_headroom` what a decode step may hold past a request's
    own tokens (speculative drafts). Seeds come from `sampling_seed`, else from `random_seed`
    and the submission order.
    """

    def __init__(
        self,
        tokenizer: Optional[PreTrainedTokenizerBase],
        vocab_size: int,
        context_len: int,
        kv_tokens: int,
        kv_headroom: int,
        page_size: int,
        random_seed: int,
        limits: Optional[RequestLimits] = None,
        routing_refusal: Optional[str] = None,
        grammars: Optional[GrammarBackend] = None,
        grammar_refusal: Optional[str] = None,
        custom_logit_processors: bool = False,
    ) -> None:
        self.limits = limits or RequestLimits()
        # Constrained decoding: what compiles grammars, or why the engine serves none.
        self.grammars = grammars
        self.grammar_refusal = grammar_refusal
        # --enable-custom-logit-processor: requests may carry code to run on their logits.
        self.custom_logit_processors = custom_logit_processors
        # Why return_routed_experts cannot be served (None: it can).
        self.routing_refusal = routing_refusal
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.kv_tokens = kv_tokens
        self.kv_headroom = kv_headroom
        self.page_size = page_size
        self.random_seed = random_seed
        # The longest token's text: a prompt of more characters than this times the context
        # cannot fit, which is known before spending seconds tokenizing megabytes.
        self._max_token_chars = (
            max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer else 1
        )
        self._submitted = 0  # requests submitted so far: the default per-request seed index
        # build() runs on worker threads (tokenizing off the event loop): the count is shared.
        self._seed_lock = threading.Lock()

    def build(self, obj: GenerateReqInput) -> tuple[list[Req], bool]:
        """Validate a call and expand it into requests (n per prompt); raises ValueError naming the
        field. Also returns whether the call was for one prompt (one output, not a list)."""
        ids_list, single = self._tokenize(obj.text, obj.input_ids)
        params = _parse_sampling_params(obj.sampling_params, len(ids_list))
        logprobs = self._logprob_options(obj, ids_list)
        self._check_routing(ids_list, obj.return_routed_experts, obj.routed_experts_start_len)
        if not isinstance(obj.stream, bool):
            raise ValueError(f"stream must be true or false, got {obj.stream!r}")
        rids = self._rids(obj.rid, len(ids_list))
        params = [self._check_request(ids, sp) for ids, sp in zip(ids_list, params)]
        self.limits.check(ids_list, params)
        processors = self._processors(obj.custom_logit_processor, len(ids_list))
        id_lists = self._token_ids_logprob(obj, logprobs)
        reqs = [
            req
            for ids, sp, rid, options, processor, chosen in zip(
                ids_list, params, rids, logprobs, processors, id_lists
            )
            for req in self._samples(obj, ids, sp, rid, options, processor, chosen)
        ]
        return reqs, single and len(reqs) == 1

    def _token_ids_logprob(
        self, obj: GenerateReqInput, logprobs: list[tuple[bool, int, int]]
    ) -> list[tuple[int, ...]]:
        """Each prompt's token_ids_logprob, checked (empty without return_logprob, as SGLang
        reports them only with it)."""
        value = obj.token_ids_logprob
        if value is None:
            return [() for _ in logprobs]
        per_prompt = value if value and isinstance(value[0], list) else [value] * len(logprobs)
        if len(per_prompt) != len(logprobs):
            raise ValueError(
                f"token_ids_logprob has {len(per_prompt)} lists for {len(logprobs)} prompts; "
                "give one list of ids, or one list per prompt"
            )
        out = []
        for ids, (want, _, _) in zip(per_prompt, logprobs):
            if not want:
                out.append(())
                continue
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise ValueError(
                        f"token_ids_logprob: {t!r} is not a token id of the vocabulary "
                        f"(0 to {self.vocab_size - 1})"
                    )
            out.append(tuple(ids))
        return out

    def _processors(self, value: Any, count: int) -> list[Optional[str]]:
        """Each prompt's custom logit processor, checked (SGLang's message when disabled)."""
        processors = _per_prompt("custom_logit_processor", value, count)
        for processor in processors:
            if processor is not None:
                if not self.custom_logit_processors:
                    raise ValueError(DISABLED)
                check_processor(processor)
        return processors

    def _logprob_options(
        self, obj: GenerateReqInput, ids_list: list[list[int]]
    ) -> list[tuple[bool, int, int]]:
        """(return_logprob, top_logprobs_num, logprob_start_len) of each prompt, checked. As in
        SGLang, each field may also be a list: one value per prompt."""
        count = len(ids_list)
        return_logprobs = _per_prompt("return_logprob", obj.return_logprob, count)
        top_nums = _per_prompt("top_logprobs_num", obj.top_logprobs_num, count)
        start_lens = _per_prompt("logprob_start_len", obj.logprob_start_len, count)
        for value in return_logprobs:
            if not isinstance(value, bool):
                raise ValueError(f"return_logprob must be true or false, got {value!r}")
        for value in top_nums:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"top_logprobs_num must be an integer, got {value!r}")
            if not 0 <= value <= self.vocab_size:
                raise ValueError(
                    f"top_logprobs_num must be in [0, {self.vocab_size}] (the vocabulary), "
                    f"got {value}"
                )
        for ids, value, want in zip(ids_list, start_lens, return_logprobs):
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                raise ValueError(
                    "logprob_start_len must be -1 (no prompt log-probs) or a prompt position, "
                    f"got {value!r}"
                )
            # As in SGLang, the start matters (and is checked) only with return_logprob; the
            # prompt's length itself scores nothing.
            if want and value > len(ids):
                raise ValueError(
                    f"logprob_start_len {value} is past the end of a {len(ids)}-token prompt; "
                    "use 0 to score the whole prompt"
                )
        return list(zip(return_logprobs, top_nums, start_lens))

    def _samples(
        self,
        obj: GenerateReqInput,
        ids: list[int],
        sp: SamplingParams,
        rid: str,
        logprobs: tuple[bool, int, int],
        processor: Optional[str] = None,
        token_ids_logprob: tuple[int, ...] = (),
    ) -> list[Req]:
        """The n requests of one prompt, each with its seed."""
        want, top_num, start = logprobs
        key = grammar_key(sp)
        if key is not None and self.grammars is None:
            raise ValueError(self.grammar_refusal or "constrained decoding is not available")
        reqs = []
        for i in range(sp.n):
            if sp.sampling_seed is not None:
                seed = derive_seed(sp.sampling_seed, i)
            else:
                with self._seed_lock:
                    seed = derive_seed(self.random_seed, self._submitted)
                    self._submitted += 1
            reqs.append(
                Req(
                    ReqInput(
                        rid=rid if sp.n == 1 else f"{rid}-{i}",
                        parent_rid=None if sp.n == 1 else rid,
                        origin_input_ids=tuple(ids),
                        sampling_params=sp,
                        seed=seed,
                        return_logprob=want,
                        # As in SGLang, top log-probs come only with return_logprob.
                        top_logprobs_num=top_num if want else 0,
                        logprob_start_len=start,
                        token_ids_logprob=token_ids_logprob,
                        stream=obj.stream,
                        return_routed_experts=obj.return_routed_experts,
                        routed_experts_start_len=obj.routed_experts_start_len,
                        custom_logit_processor=processor,
                    ),
                    grammar=None if key is None else self.grammars.grammar(key),
                )
            )
        return reqs

    def _check_routing(self, ids_list: list[list[int]], want: bool, start: int) -> None:
        """SGLang's fields: return_routed_experts a bool, routed_experts_start_len in
        [0, prompt tokens] (the rows then cover [start, prompt + output - 1))."""
        if not isinstance(want, bool):
            raise ValueError(f"return_routed_experts must be true or false, got {want!r:.80}")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(
                f"routed_experts_start_len must be a non-negative integer, got {start!r:.80}"
            )
        if not want:
            return
        if self.routing_refusal is not None:
            raise ValueError(f"return_routed_experts: {self.routing_refusal}")
        shortest = min(len(ids) for ids in ids_list)
        if start > shortest:
            raise ValueError(
                f"routed_experts_start_len {start} is past the end of a {shortest}-token prompt; "
                "use at most the prompt's length (0: the whole sequence)"
            )

    def _tokenize(self, prompt: Prompt, input_ids: InputIds) -> tuple[list[list[int]], bool]:
        """Each prompt's token ids, and whether one prompt was given (not a list)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) or input_ids")
        if prompt is not None:
            return self._tokenize_text(prompt)
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError(
                "input_ids must be a non-empty list of token ids (or a list of such lists)"
            )
        single = not isinstance(input_ids[0], list)
        batch = [input_ids] if single else input_ids
        vocab = self.vocab_size
        for ids in batch:
            if not isinstance(ids, list) or not ids:
                raise ValueError("input_ids is empty; give at least one token id")
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"input_ids must hold integers, got {t!r}")
                if not 0 <= t < vocab:
                    raise ValueError(
                        f"input_ids has token id {t}, outside the vocabulary [0, {vocab})"
                    )
        return batch, single

    def _tokenize_text(self, prompt: Union[str, list[str]]) -> tuple[list[list[int]], bool]:
        if self.tokenizer is None:
            raise ValueError(
                "a text prompt needs a tokenizer, but the engine runs with "
                "--skip-tokenizer-init; send input_ids"
            )
        single = isinstance(prompt, str)
        prompts = [prompt] if single else prompt
        if (
            not isinstance(prompts, list)
            or not prompts
            or not all(isinstance(p, str) for p in prompts)
        ):
            raise ValueError("prompt must be a string or a non-empty list of strings")
        if any(p == "" for p in prompts):
            raise ValueError("prompt is empty; give at least one token of text")
        for p in prompts:
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"prompt is not valid Unicode text ({e.reason} at character {e.start}, "
                    "e.g. a lone surrogate escape); send UTF-8 text"
                ) from None
        longest = max(len(p) for p in prompts)
        if longest > self.context_len * self._max_token_chars:
            raise ValueError(
                f"the prompt has {longest} characters, more than {self.context_len} tokens "
                f"(the context length) can hold; shorten it"
            )
        return [self._encode(p) for p in prompts], single

    def _encode(self, text: str) -> list[int]:
        """Token ids of `text`. With a fast tokenizer the length is checked before the ids become
        Python ints: converting a million of them would hold the GIL (and the event loop) for a
        while, only to refuse the prompt."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer(text)["input_ids"]
        # encode_batch releases the GIL while it works (encode does not).
        (encoding,) = backend.encode_batch([text])
        if len(encoding) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(encoding)} tokens, which does not fit the context length "
                f"{self.context_len}; shorten it"
            )
        return encoding.ids

    def _check_request(self, ids: list[int], sp: SamplingParams) -> SamplingParams:
        """Refuse what the engine cannot serve; resolve max_new_tokens=None to what fits."""
        sp.check_vocab(self.vocab_size)
        if sp.stop and self.tokenizer is None:
            raise ValueError(
                "sampling_params.stop (strings) needs a tokenizer, but the engine runs with "
                "--skip-tokenizer-init; use stop_token_ids"
            )
        n = len(ids)
        page = self.page_size
        # A decode step may hold draft tokens past the request's own sequence.
        pool = self.kv_tokens - self.kv_headroom
        limit = min(self.context_len, pool // page * page)
        if n >= limit:
            raise ValueError(
                f"the prompt has {n} tokens, which does not fit the context length "
                f"{self.context_len}"
                f" / KV cache of {self.kv_tokens} tokens; shorten it"
            )
        if sp.max_new_tokens is None:
            sp = dataclasses.replace(sp, max_new_tokens=limit - n)
        if n + sp.max_new_tokens > self.context_len:
            raise ValueError(
                f"max_new_tokens={sp.max_new_tokens} with a {n}-token prompt exceeds the context "
                "length "
                f"{self.context_len}; lower max_new_tokens to at most {self.context_len - n}"
            )
        need = -(-(n + sp.max_new_tokens) // page) * page
        if need > pool:
            raise ValueError(
                f"the request needs {need} KV tokens (plus {self.kv_tokens - pool} for "
                f"speculative drafts) but the KV cache holds {self.kv_tokens}; "
                "lower max_new_tokens, or raise --max-total-tokens / --mem-fraction-static"
            )
        return sp

    def _rids(self, rid: Union[str, list[str], None], count: int) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        rids = [rid] if isinstance(rid, str) else rid
        if (
            not isinstance(rids, list)
            or len(rids) != count
            or not all(isinstance(r, str) for r in rids)
        ):
            raise ValueError(f"rid must be a string per prompt ({count} expected), got {rid!r}")
        return rids


def _parse_sampling_params(sampling_params: Params, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: a list gives one each, a dict (or None) is shared."""
    if not isinstance(sampling_params, list):
        return [SamplingParams.from_dict(sampling_params)] * count
    if len(sampling_params) != count:
        raise ValueError(f"sampling_params has {len(sampling_params)} entries for {count} prompts")
    return [SamplingParams.from_dict(p) for p in sampling_params]


def _per_prompt(name: str, value: Any, count: int) -> list[Any]:
    """A field given once for every prompt, or as a list with one value per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise ValueError(
            f"{name} has {len(value)} entries for {count} prompts; give one per prompt"
        )
    return value
