"""SGLang's custom logit processors (--enable-custom-logit-processor): a request carries a
`CustomLogitProcessor` subclass serialized by `to_str()` (dill, hex, in JSON), and the engine
runs it on the request's logits rows with its `custom_params`. This executes the client's
Python code inside the engine: the flag is off by default, and with it off a request carrying
a processor gets SGLang's 400.

As in SGLang the processor sees logits after the penalties and the grammar mask, before the
temperature, and each row's params dict holds the request under "__req__" (its
`origin_input_ids` and `output_ids`). At speculative verify every tree node's row gets the
request as it would stand at that node (`output_ids` with the node's draft path), so a processor
that reads the output so far stays lossless. Processors serialized by SGLang's own class
(`sglang.srt.sampling.custom_logit_processor.CustomLogitProcessor`) load without SGLang: that
base resolves to this module's.
"""

from __future__ import annotations

import io
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import torch

DISABLED = (
    "The server is not configured to enable custom logit processor. "
    "Please set `--enable-custom-logit-processor` to enable this feature."
)
_SGLANG_MODULE = "sglang.srt.sampling.custom_logit_processor"


class CustomLogitProcessor(ABC):
    """SGLang's interface: called with a request group's logits rows and one params dict per
    row; returns the new logits (it may change them in place)."""

    @abstractmethod
    def __call__(
        self, logits: torch.Tensor, custom_param_list: Optional[list[dict[str, Any]]] = None
    ) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def to_str(cls) -> str:
        """The class serialized as SGLang does: {"callable": hex of dill.dumps(cls)}."""
        import dill

        return json.dumps({"callable": dill.dumps(cls).hex()})

    @classmethod
    def from_str(cls, json_str: str) -> CustomLogitProcessor:
        """A new instance of the class `to_str` serialized."""
        return _class_from_str(json_str)()


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """SGLang's example: custom_params {"token_ids": [...]} may never be drawn."""

    def __call__(
        self, logits: torch.Tensor, custom_param_list: Optional[list[dict[str, Any]]] = None
    ) -> torch.Tensor:
        for i, params in enumerate(custom_param_list or []):
            logits[i, params["token_ids"]] = float("-inf")
        return logits


@lru_cache(maxsize=64)
def _class_from_str(json_str: str) -> type:
    import dill

    class _Unpickler(dill.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module == _SGLANG_MODULE and name in globals():
                return globals()[name]
            return super().find_class(module, name)

    data = json.loads(json_str)
    return _Unpickler(io.BytesIO(bytes.fromhex(data["callable"]))).load()


def check_processor(json_str: Any) -> None:
    """ValueError naming the problem when `json_str` does not load as a processor class."""
    if not isinstance(json_str, str):
        raise ValueError(
            f"custom_logit_processor must be the string CustomLogitProcessor.to_str() gives, "
            f"got {json_str!r:.80}"
        )
    try:
        loaded = _class_from_str(json_str)
    except Exception as e:  # whatever the client's bytes raise while loading
        raise ValueError(
            f"custom_logit_processor could not be loaded ({type(e).__name__}: {e}); send "
            "CustomLogitProcessor.to_str() of a subclass"
        ) from None
    if not (isinstance(loaded, type) and callable(loaded)):
        raise ValueError(
            f"custom_logit_processor holds {type(loaded).__name__}, not a CustomLogitProcessor "
            "class; send CustomLogitProcessor.to_str() of a subclass"
        )


@dataclass
class ProcessorReq:
    """What a processor's "__req__" shows of a request (SGLang's Req field names)."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]
    sampling_params: Any


def apply_processors(
    logits: torch.Tensor, reqs: Sequence[Any], outputs: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Row r belongs to reqs[r] (a core.request.Req), whose output before that row is
    outputs[r]; rows of requests with a processor go through it, grouped by processor.
    Returns logits itself when no request has one."""
    groups: dict[str, list[int]] = {}
    for r, req in enumerate(reqs):
        if req.input.custom_logit_processor is not None:
            groups.setdefault(req.input.custom_logit_processor, []).append(r)
    if not groups:
        return logits
    out = logits.clone()
    for json_str, rows in groups.items():
        params = []
        for r in rows:
            req = reqs[r]
            sp = req.input.sampling_params
            view = ProcessorReq(
                req.input.rid, list(req.input.origin_input_ids), list(outputs[r]), sp
            )
            params.append({**(sp.custom_params or {}), "__req__": view})
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        out[index] = CustomLogitProcessor.from_str(json_str)(out[index], params)
    return out


def apply_processors_to_trees(
    logits: torch.Tensor,
    reqs: Sequence[Any],
    parents: Sequence[Sequence[int]],
    tokens: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Speculative verify: request i's rows are its tree's nodes; each row sees the request's
    output followed by the node's draft path."""
    if all(r.input.custom_logit_processor is None for r in reqs):
        return logits
    row_reqs, outputs = [], []
    for req, ps, ts in zip(reqs, parents, tokens):
        paths: list[list[int]] = []
        for node, parent in enumerate(ps):
            paths.append([] if parent < 0 else [*paths[parent], ts[node]])
        row_reqs.extend([req] * len(ps))
        outputs.extend(req.output_ids + path for path in paths)
    return apply_processors(logits, row_reqs, outputs)
