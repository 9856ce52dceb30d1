"""spec_engine: the specrl rollout engine (continuous batching, paged KV, speculative decoding)."""

__version__ = "0.1.0"

from spec_engine.config import EngineArgs  # noqa: E402
from spec_engine.engine import Engine  # noqa: E402

__all__ = ["Engine", "EngineArgs", "__version__"]
