"""Tokenizer loading and detokenization helpers (Hugging Face tokenizers, local files only)."""

from __future__ import annotations

import os
from typing import Optional

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str, chat_template: Optional[str] = None) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {path!r} ({e}); pass --tokenizer-path, "
                         "or --skip-tokenizer-init to send input_ids only") from e
    if chat_template is not None:
        if not os.path.isfile(chat_template):
            raise ValueError(f"--chat-template {chat_template!r} is not a file; give the path of a Jinja template")
        with open(chat_template) as f:
            tokenizer.chat_template = f.read()
    return tokenizer


def decode_text(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool = True,
                spaces_between_special_tokens: bool = True, partial: bool = False) -> str:
    """Decode ids; with `partial`, drop a trailing incomplete UTF-8 character (shown as U+FFFD)."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                            spaces_between_special_tokens=spaces_between_special_tokens)
    if partial:
        text = text.rstrip("\ufffd")
    return text
