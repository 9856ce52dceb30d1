"""torch.profiler started and stopped on request (SGLang's /start_profile, /stop_profile): a
Chrome trace of everything between the two calls."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch

_ACTIVITIES = {
    "CPU": torch.profiler.ProfilerActivity.CPU,
    "GPU": torch.profiler.ProfilerActivity.CUDA,
    "CUDA": torch.profiler.ProfilerActivity.CUDA,
}


class Profiler:
    def __init__(self) -> None:
        self.profile: Optional[torch.profiler.profile] = None
        self.output_dir = ""

    def start(
        self,
        output_dir: Optional[str],
        activities: Optional[list[str]],
        with_stack: Optional[bool],
        record_shapes: Optional[bool],
    ) -> dict[str, Any]:
        if self.profile is not None:
            raise ValueError("a profile is running already; call stop_profile first")
        names = activities or ["CPU", "GPU"]
        unknown = [a for a in names if a not in _ACTIVITIES and a != "MEM"]
        if unknown:
            raise ValueError(f"unknown profiler activities {unknown}; use CPU, GPU")
        kinds = {_ACTIVITIES[a] for a in names if a in _ACTIVITIES}
        if not torch.cuda.is_available():
            kinds.discard(torch.profiler.ProfilerActivity.CUDA)
        self.output_dir = output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
        os.makedirs(self.output_dir, exist_ok=True)
        self.profile = torch.profiler.profile(
            activities=sorted(kinds, key=str),
            with_stack=bool(with_stack),
            record_shapes=bool(record_shapes),
        )
        self.profile.__enter__()
        return {"success": True, "message": f"profiling; the trace goes to {self.output_dir}"}

    def stop(self) -> dict[str, Any]:
        if self.profile is None:
            raise ValueError("no profile is running; call start_profile first")
        profile, self.profile = self.profile, None
        profile.__exit__(None, None, None)
        path = os.path.join(self.output_dir, f"specrl-{time.time():.0f}.trace.json")
        profile.export_chrome_trace(path)
        return {"success": True, "message": f"trace written to {path}", "path": path}
