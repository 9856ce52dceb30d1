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
# With --colocate, the part of a shared bundle each actor asks for (slime's numbers): together
# under one, so a trainer rank and an engine land on the same device.
COLOCATED_TRAINER_SHARE = 0.4
COLOCATED_ENGINE_SHARE = 0.2

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
    --debug-rollout-only), from the launcher's flags. With --colocate both share one set of
    bundles (max of the two counts), as in slime: each trainer rank takes 0.4 of its bundle's
    device and each engine 0.2, so Ray puts them on the same GPU."""
    engines, trainer = [], []
    per_engine = args.rollout_num_gpus_per_engine
    num_engines = 0 if args.debug_train_only else args.rollout_num_gpus // per_engine
    num_ranks = (
        0 if args.debug_rollout_only else args.actor_num_nodes * args.actor_num_gpus_per_node
    )
    if args.colocate and num_engines and num_ranks:
        shared = reserve_bundles(
            max(num_ranks, args.rollout_num_gpus),
            1,
            "--actor-num-gpus-per-node / --rollout-num-gpus",
        )
        trainer = [share(shared[i], COLOCATED_TRAINER_SHARE) for i in range(num_ranks)]
        engines = [
            share(shared[i * per_engine], COLOCATED_ENGINE_SHARE) for i in range(num_engines)
        ]
        return Placements(engines, trainer)
    if num_engines:
        engines = reserve_bundles(num_engines, per_engine, "--rollout-num-gpus")
    if num_ranks:
        trainer = reserve_bundles(num_ranks, 1, "--actor-num-nodes x --actor-num-gpus-per-node")
    return Placements(engines, trainer)


def share(options: dict[str, Any], fraction: float) -> dict[str, Any]:
    """The actor options of a bundle, taking `fraction` of its device (and CPU)."""
    resource = "num_gpus" if options["num_gpus"] else "num_cpus"
    return {**options, "num_cpus": 0, "num_gpus": 0, resource: options[resource] * fraction}
