"""What a loader reads from safetensors files: whole tensors vs slices (shard-loading tests)."""

from __future__ import annotations

from typing import Any

from safetensors import safe_open


def record_reads(monkeypatch: Any) -> tuple[list[str], list[str]]:
    """Patch weights.loader's safe_open; returns (names read whole, names read as slices)."""
    whole: list[str] = []
    sliced: list[str] = []

    class Recording:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.f = safe_open(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.f.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self.f.__exit__(*exc)

        def keys(self) -> Any:
            return self.f.keys()

        def get_tensor(self, name: str) -> Any:
            whole.append(name)
            return self.f.get_tensor(name)

        def get_slice(self, name: str) -> Any:
            sliced.append(name)
            return self.f.get_slice(name)

    monkeypatch.setattr("spec_engine.weights.loader.safe_open", Recording)
    return whole, sliced
