"""SGLang's scoring (TokenizerManager.score_request), shared by Engine.score and /v1/score: for
each item, the probability of each label token at the next position after query + item (or item +
query).

Each (query, item) pair is one prompt; the labels' next-token log-probs (over the whole
vocabulary) come from one forward, a one-token generation with token_ids_logprob = the labels:
exp(logprob) (the full-vocabulary probability), or with apply_softmax a softmax over the labels'
log-probs only (the same as a softmax over their logits).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

Query = Union[str, list[int], None]
Items = Union[str, list[str], list[list[int]], None]


def score_generate_kwargs(
    query: Query,
    items: Items,
    label_token_ids: Optional[list[int]],
    item_first: bool,
    vocab_size: int,
) -> Optional[dict[str, Any]]:
    """Engine.generate's keyword arguments scoring every item (None for no items); refuses what
    SGLang refuses, with its messages (ValueError)."""
    if label_token_ids is None:
        raise ValueError("label_token_ids must be provided")
    if items is None:
        raise ValueError("items must be provided")
    if not items:
        return None
    for token_id in label_token_ids:
        # SGLang checks the upper end only (a negative id fails later, as a 500 there).
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"Token ID {token_id} is out of vocabulary (vocab size: {vocab_size})")
    pair = (lambda item: item + query) if item_first else (lambda item: query + item)
    if isinstance(query, str) and (isinstance(items, str) or isinstance(items[0], str)):
        texts = [items] if isinstance(items, str) else items
        prompts: dict[str, Any] = {"prompt": [pair(item) for item in texts]}
    elif isinstance(query, list) and isinstance(items, list) and isinstance(items[0], list):
        prompts = {"input_ids": [pair(item) for item in items]}
    else:
        raise ValueError("Invalid combination of query/items types for score_request.")
    return dict(
        **prompts,
        # The labels' log-probs at the next position after the prompt.
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        token_ids_logprob=label_token_ids,
    )


def label_scores(out: dict, label_token_ids: list[int], apply_softmax: bool) -> list[float]:
    """The labels' scores from one prompt's first output position (SGLang's
    _convert_logprobs_to_scores)."""
    if not label_token_ids:  # nothing asked, so the output carries no token_ids log-probs
        return []
    chosen = out["meta_info"]["output_token_ids_logprobs"][0]
    # null: a log-prob of -inf (JSON has no infinity).
    picked = [float("-inf") if lp is None else lp for lp, _, _ in chosen]
    if apply_softmax:
        return torch.softmax(torch.tensor(picked, dtype=torch.float64, device="cpu"), 0).tolist()
    return [math.exp(lp) for lp in picked]
