"""Tokenizer loading and detokenization helpers (Hugging Face tokenizers, local files only)."""

from __future__ import annotations

import os
from typing import Optional

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# Prompt tokens kept as left context when decoding a stream incrementally, so tokenizers whose
# decoding depends on the previous token (sentencepiece's leading spaces) stay exact.
_CONTEXT_TOKENS = 5


def load_tokenizer(path: str, chat_template: Optional[str] = None) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"could not load a tokenizer from {path!r} ({e}); pass --tokenizer-path, "
            "or --skip-tokenizer-init to send input_ids only"
        ) from e
    if chat_template is not None:
        if not os.path.isfile(chat_template):
            raise ValueError(
                f"--chat-template {chat_template!r} is not a file; give the path of a Jinja "
                "template"
            )
        with open(chat_template) as f:
            tokenizer.chat_template = f.read()
    return tokenizer


def decode_text(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> str:
    return tokenizer.decode(
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )


class IncrementalDetokenizer:
    """Text of a growing output, decoding only the newest tokens each time.

    New text is taken once it no longer ends in an incomplete UTF-8 character (U+FFFD), so
    streamed text never shows half a character.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; returns all text that is complete so far."""
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset], **self.kwargs
        )
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], **self.kwargs)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self.text
