"""rollout: RL-side orchestration on Ray (engines behind a router, samples, rewards).

Main entry points: `RolloutArgs` (flags), `RolloutManager` (rollouts and eval), `Sample` (what
the trainer consumes), `MetricsLogger`, and `EngineActor` / `RayEngineHandle` in
`rollout.engine_actor` for engines as Ray actors.
"""

from rollout.config import RolloutArgs, add_cli_args, from_cli_args
from rollout.debug_data import load_debug_rollout_data, save_debug_rollout_data
from rollout.manager import RolloutManager
from rollout.metrics import MetricsLogger, rollout_metrics
from rollout.sample import Sample, Status

__all__ = [
    "RolloutArgs",
    "add_cli_args",
    "from_cli_args",
    "RolloutManager",
    "Sample",
    "Status",
    "MetricsLogger",
    "rollout_metrics",
    "save_debug_rollout_data",
    "load_debug_rollout_data",
]
