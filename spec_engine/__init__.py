"""spec_engine: the specrl rollout engine (continuous batching, paged KV, speculative decoding).

`from spec_engine import Engine, EngineArgs` is the public API. They are imported on first use,
so that importing a light module (say `spec_engine.models.hf_config` from the trainer) does not
load the whole engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from spec_engine.version import __version__

if TYPE_CHECKING:
    from spec_engine.args.engine_args import EngineArgs
    from spec_engine.engine import Engine

_LAZY = {"Engine": "spec_engine.engine", "EngineArgs": "spec_engine.args.engine_args"}

__all__ = ["Engine", "EngineArgs", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spec_engine' has no attribute {name!r}")
