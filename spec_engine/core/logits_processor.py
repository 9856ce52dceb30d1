"""Per-request changes to the target's logits before anything is drawn or reported: SGLang's
repetition, frequency and presence penalties and logit_bias, and slime's top-p replay data.

One function serves plain decoding and speculative verification, so speculation stays exact:
a verify row is penalised with the tokens its request would have emitted up to that node (the
output so far plus the draft path), exactly what plain decoding sees at that position. As in
SGLang, the penalties count output tokens only (not the prompt), in SGLang's order: frequency
subtracts penalty x count and presence subtracts penalty once per seen token, then repetition
divides the positive logits and multiplies the negative ones of every seen token, then
logit_bias adds its values. Reported log-probs come from the processed logits, as SGLang's do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

import torch

from spec_engine.core.sampling_params import SamplingParams
from spec_engine.layers.sampler import filtered_probs

logger = logging.getLogger(__name__)


def process_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], contexts: Sequence[Sequence[int]]
) -> torch.Tensor:
    """logits [R, vocab] (float32); row r belongs to a request with params[r], whose emitted
    tokens before that row are contexts[r]. Returns logits unchanged when no row asks for
    anything, else a processed copy."""
    rows = [r for r, sp in enumerate(params) if sp.changes_logits]
    if not rows:
        return logits
    out = logits.clone()
    device = logits.device
    for r in rows:
        sp, row = params[r], out[r]
        penalised = sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0
        if contexts[r] and penalised:
            seen, counts = torch.tensor(list(contexts[r]), dtype=torch.int64, device=device).unique(
                return_counts=True
            )
            # SGLang's order (its accumulated additive, then scaling penalties): frequency and
            # presence subtract first, the repetition penalty then scales the result.
            values = row[seen] - sp.frequency_penalty * counts - sp.presence_penalty
            if sp.repetition_penalty != 1.0:
                penalty = sp.repetition_penalty
                values = torch.where(values < 0, values * penalty, values / penalty)
            row[seen] = values
        if sp.logit_bias:
            ids = torch.tensor([int(t) for t in sp.logit_bias], dtype=torch.int64, device=device)
            bias = torch.tensor(list(sp.logit_bias.values()), dtype=row.dtype, device=device)
            row.index_add_(0, ids, bias)
    return out


NONFINITE_LOGITS = (
    "the model produced NaN/Inf logits for this request, so its tokens would be meaningless; "
    "check the weights and the dtype (--enable-nan-detection samples around NaN logits, as "
    "SGLang does)"
)


def nonfinite_flags(logits: torch.Tensor) -> torch.Tensor:
    """[R] bool on the device: rows holding NaN or +Inf (a broken forward; -Inf is a legitimate
    mask). Read back with the step's tokens (core.readback), not on its own."""
    return (torch.isnan(logits) | torch.isposinf(logits)).any(-1)


def replace_nan(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """--enable-nan-detection: NaN logits become -1e5 (SGLang's handling), without a read;
    returns them and the [R] flags of rows that held NaN, for `warn_nan` once they are read."""
    nan = torch.isnan(logits)
    return logits.masked_fill(nan, -1e5), nan.any(-1)


def warn_nan(flags: list[int]) -> None:
    """The warning of `replace_nan`, from its flags read back."""
    if any(flags):
        logger.warning(
            "NaN in the logits of %d of %d rows; they are sampled as if those logits were -1e5",
            sum(flags),
            len(flags),
        )


def top_p_replay(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[int]
) -> tuple[list[list[int]], list[float]]:
    """slime's top-p replay (its SGLang patch): per row, the nucleus its token was drawn from
    (top-k/top-p/min-p kept ids, most probable first; the token itself for greedy rows) and the
    token's log-prob renormalised over nucleus + token, which slime's trainer recomputes."""
    nuclei, logprobs = [], []
    for row, sp, token in zip(logits, params, tokens):
        probs = torch.softmax(row / sp.logit_scale, -1)
        if sp.is_greedy:
            kept = [token]
        else:
            vocab = probs.shape[-1]
            top_k = vocab if sp.top_k < 0 else min(sp.top_k, vocab)
            kept_p, ids = filtered_probs(
                probs[None],
                torch.tensor([top_k], device=probs.device),
                torch.tensor([sp.top_p], device=probs.device),
                torch.tensor([sp.min_p], device=probs.device),
            )
            kept = ids[0][kept_p[0] > 0].tolist()
        mass = probs[kept].sum() + (0.0 if token in kept else probs[token])
        nuclei.append(kept)
        logprobs.append(float(torch.log(probs[token] / mass)))
    return nuclei, logprobs


def wants_top_p_replay(sp: SamplingParams) -> bool:
    """slime asks with custom_params {"return_top_p_token_ids": true} when its top_p < 1."""
    custom: Optional[dict] = sp.custom_params
    return bool(custom and custom.get("return_top_p_token_ids")) and sp.top_p < 1.0
