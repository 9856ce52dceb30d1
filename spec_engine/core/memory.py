"""MemoryController: the one owner of pause and memory-release state.

Generation runs only while it is not paused and the weights and KV cache are in memory
(released CUDA graphs mean eager forwards until they are resumed). The engine calls this
controller for `pause_generation` / `continue_generation`, `release_memory_occupation` /
`resume_memory_occupation` and `flush_cache`; nothing else changes that state. Releasing
frees the tensors behind a tag (weights, the KV cache, captured CUDA graphs); resuming makes
them again, and graphs are captured again once nothing is released, because they read the old
buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from spec_engine.core.scheduler import Scheduler
from spec_engine.runner.base import RunnerBase
from spec_engine.runner.graph_capture import new_pool
from spec_engine.weights.updater import WeightUpdater

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
PAUSE_MODES = ("abort", "retract", "in_place")


class MemoryController:
    def __init__(
        self, scheduler: Scheduler, runners: Sequence[RunnerBase], weights: WeightUpdater
    ) -> None:
        self.scheduler = scheduler
        self.runners = list(runners)  # the target first, then the draft (their KV pools and graphs)
        self.weights = weights
        self.paused = False
        self.released: set[str] = set()

    @property
    def generation_allowed(self) -> bool:
        # Without captured graphs the runners run eagerly: only weights and KV are needed.
        return not self.paused and not (self.released - {"cuda_graph"})

    def pause(self, mode: str) -> None:
        """Stop generating. abort: end every request; retract: put running requests back in the
        queue (their KV released, recomputed on resume); in_place: keep them and their KV."""
        if mode not in PAUSE_MODES:
            raise ValueError(
                f"pause mode must be one of {', '.join(map(repr, PAUSE_MODES))}, got {mode!r}"
            )
        if mode == "abort":
            self.scheduler.abort_all("generation paused with mode 'abort'")
        elif mode == "retract":
            self.scheduler.retract_all()
        self.paused = True

    def unpause(self) -> None:
        self.paused = False

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are queued or running, unless
        paused."""
        return self.scheduler.flush_cache(paused=self.paused)

    def require_weights(self) -> None:
        """Raise unless the weights are in memory (updates and checksums need them)."""
        if "weights" in self.released:
            raise ValueError("weights are released; call resume_memory_occupation first")

    def release(self, tags: Optional[Sequence[str]] = None) -> None:
        """Free the memory behind `tags` (all by default) until resume()."""
        tags = check_tags(tags)
        if "kv_cache" in tags and "kv_cache" not in self.released:
            if self.scheduler.holds_kv():
                raise ValueError(
                    "cannot release the KV cache while requests hold it; pause_generation with "
                    "mode "
                    "'retract' or 'abort' first"
                )
            self.scheduler.drop_prefix_cache()
            for pool in self._kv_pools():
                pool.release()
        if "weights" in tags:
            self.weights.release_weights()
        if "cuda_graph" in tags:
            for runner in self.runners:
                runner.release_graphs()
        self.released |= tags

    def resume(self, tags: Optional[Sequence[str]] = None) -> None:
        tags = check_tags(tags)
        if "kv_cache" in tags and "kv_cache" in self.released:
            for pool in self._kv_pools():
                pool.allocate()
        if "weights" in tags:
            self.weights.resume_weights()
        # Graphs read the old KV buffers and weights: capture again once all three are back.
        replaced = tags & self.released
        self.released -= tags
        if replaced and not self.released:
            self._capture_graphs()

    def recapture_graphs(self) -> None:
        """Capture every graph again (SGLang's recapture_cuda_graph), unless graphs or what they
        read are released: resuming captures them then."""
        if not self.released:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """Capture every runner's graphs into one new memory pool: torch frees a pool whose graphs
        are all gone and asserts when a capture names it again (seen on an H200 after a colocated
        release and resume)."""
        pool = new_pool(self.runners[0].device)
        for runner in self.runners:
            runner.graph_pool = pool
            runner.capture_graphs()

    def _kv_pools(self) -> list:
        """Each KV pool once (a self-draft runs on the target's)."""
        return list({id(r.kv_pool): r.kv_pool for r in self.runners}.values())


def check_tags(tags: Optional[Sequence[str]]) -> set[str]:
    if tags is None:
        return set(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; use {', '.join(MEMORY_TAGS)}")
    return set(tags)
