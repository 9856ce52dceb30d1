"""Grammars as SGLang compiles them (its xgrammar backend): a request's `regex`, `json_schema`
or `ebnf` becomes a key, the key a compiled grammar (cached: every request with the same key
shares it), and each request gets a matcher of its own that follows its output tokens.

xgrammar is imported on the first grammar request, so an engine that serves none does not pay
its import. A grammar that does not compile fails its request with SGLang's 400 message.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

# The sampling params that ask for a grammar, with the key type SGLang compiles them under.
GRAMMAR_KEYS = {"json_schema": "json", "regex": "regex", "ebnf": "ebnf"}
# Compiled grammars kept (the oldest dropped first): a client sending new schemas without end
# must not grow the engine's memory without end.
CACHE_SIZE = 1024
NONE_BACKEND = (
    "Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not supported when "
    "the server is launched with --grammar-backend none"
)

GrammarKey = tuple[str, str]


def grammar_key(params: Any) -> Optional[GrammarKey]:
    """(SGLang's key type, the grammar text) a request's sampling params ask for, or None."""
    for field, kind in GRAMMAR_KEYS.items():
        value = getattr(params, field)
        if value is not None:
            return kind, value
    return None


class Grammar:
    """One request's grammar state: the tokens it accepted so far decide which may come next."""

    def __init__(self, matcher: Any, key: GrammarKey) -> None:
        self.matcher = matcher
        self.key = key

    def accept_token(self, token: int) -> bool:
        """Advance by `token`; False (nothing changes) when the grammar does not allow it."""
        return self.matcher.accept_token(token)

    def rollback(self, count: int) -> None:
        self.matcher.rollback(count)

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit t % 32 of word
        t // 32 set when token t is allowed)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarBackend:
    """SGLang's xgrammar backend: compiles keys for a tokenizer and a vocabulary (the model's,
    which may be larger than the tokenizer's), stopping at the model's EOS tokens."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        any_whitespace: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.any_whitespace = any_whitespace
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler: Any = None
        self._cache: dict[GrammarKey, Any] = {}
        # Requests are built on several threads at once (tokenizing off the event loop).
        self._lock = threading.Lock()

    def grammar(self, key: GrammarKey) -> Grammar:
        """A fresh matcher for `key`; ValueError with SGLang's message when it does not compile."""
        import xgrammar

        compiled = self._compiled(key)
        matcher = xgrammar.GrammarMatcher(compiled)  # rolls back any number of tokens
        return Grammar(matcher, key)

    def _compiled(self, key: GrammarKey) -> Any:
        with self._lock:
            if key in self._cache:
                compiled = self._cache[key]
            else:
                compiled = self._cache[key] = self._compile(key)
                if len(self._cache) > CACHE_SIZE:
                    del self._cache[next(iter(self._cache))]
        if compiled is None:
            # SGLang's message (and status) for a grammar that does not compile; its reason is
            # logged where it was compiled.
            raise ValueError(f"Invalid grammar request: req.grammar_key={key!r}")
        return compiled

    def _compile(self, key: GrammarKey) -> Any:
        """The compiled grammar, or None when it does not compile (the reason is logged)."""
        import xgrammar

        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            self._compiler = xgrammar.GrammarCompiler(info)
        kind, text = key
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(
                    schema=text, any_whitespace=self.any_whitespace
                )
            if kind == "regex":
                return self._compiler.compile_regex(text)
            return self._compiler.compile_grammar(text)
        except (RuntimeError, json.JSONDecodeError) as e:
            logger.error("Hit invalid %s: %r, %s", kind, text[:200], e)
            return None


def create_grammar_backend(
    args: Any, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], tp_size: int
) -> tuple[Optional[GrammarBackend], Optional[str]]:
    """The engine's grammar backend (EngineArgs.grammar_backend), or why grammar requests are
    refused (None, the reason)."""
    if args.grammar_backend == "none":
        return None, NONE_BACKEND
    if tokenizer is None:
        return None, (
            "constrained decoding (json_schema, regex, ebnf) needs the tokenizer, but the engine "
            "runs with --skip-tokenizer-init; start it without that flag"
        )
    if tp_size > 1:
        return None, (
            "constrained decoding (json_schema, regex, ebnf) runs at --tp-size 1 for now (each "
            "rank would need its own grammar state); serve it from an engine with --tp-size 1"
        )
    any_whitespace = not args.constrained_json_disable_any_whitespace
    return GrammarBackend(tokenizer, vocab_size, eos_token_ids, any_whitespace), None
