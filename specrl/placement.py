"""Ray for a run: `init_ray` starts (or joins) it, `reserve_bundles` reserves the devices of a
group of actors and returns the options that pin each actor to its own bundle, and
`create_placements` does so for the engines and the trainer ranks from the launcher's flags.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

PLACEMENT_TIMEOUT_S = 120

ActorOptions = list[dict[str, Any]]


class Placements(NamedTuple):
    """Ray actor options, one per engine and one per trainer rank."""

    engines: ActorOptions
    trainer: ActorOptions


def init_ray(num_cpus: int | None = None) -> None:
    """A local Ray (or the one already running): every worker imports this checkout and filters
    the known noise (specrl.console); Ray itself logs warnings only."""
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        ignore_reinit_error=True,
        logging_level=logging.WARNING,
        runtime_env={
            "env_vars": {"PYTHONPATH": worker_pythonpath(os.getcwd(), os.environ)},
            "worker_process_setup_hook": "specrl.console.quiet_known_noise",
        },
    )


def worker_pythonpath(cwd: str, environ: Mapping[str, str]) -> str:
    """PYTHONPATH for Ray workers: this checkout first, then the caller's own PYTHONPATH (Ray's
    env_vars replace the variable, which would hide packages installed with `pip --target`)."""
    entries = [cwd] + [e for e in environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    return os.pathsep.join(dict.fromkeys(entries))


def reserve_bundles(count: int, gpus_per_bundle: int, what: str) -> ActorOptions:
    """Ray actor options, one per bundle of a new placement group of `count` bundles
    (`gpus_per_bundle` GPUs each, else one CPU each); `what` names the flags to change when the
    cluster is too small. The group lives as long as Ray does."""
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    bundle = {"GPU": gpus_per_bundle, "CPU": 1} if gpus else {"CPU": 1}
    group = placement_group([bundle] * count)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"Ray could not place {count} x {bundle} within {PLACEMENT_TIMEOUT_S} s (cluster: "
            f"{ray.cluster_resources()}); lower {what} or add resources (--ray-num-cpus on CPU)"
        ) from None
    return [
        dict(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i
            ),
        )
        for i in range(count)
    ]


def create_placements(args: argparse.Namespace) -> Placements:
    """Bundles for the engines (none with --debug-train-only) and the trainer ranks (none with
    --debug-rollout-only), from the launcher's flags."""
    engines, trainer = [], []
    if not args.debug_train_only:
        per_engine = args.rollout_num_gpus_per_engine
        engines = reserve_bundles(
            args.rollout_num_gpus // per_engine, per_engine, "--rollout-num-gpus"
        )
    if not args.debug_rollout_only:
        trainer = reserve_bundles(
            args.actor_num_nodes * args.actor_num_gpus_per_node,
            1,
            "--actor-num-nodes x --actor-num-gpus-per-node",
        )
    return Placements(engines, trainer)
