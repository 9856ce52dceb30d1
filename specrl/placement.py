"""Ray for a run: `init_ray` starts (or joins) it, `reserve_bundles` reserves the devices of a
group of actors and returns the options that pin each actor to its own bundle, and
`create_placements` does so for the engines and the trainer ranks from the launcher's flags.

Bundles are one per device, as in slime: an engine of --rollout-num-gpus-per-engine N devices is
one actor in the first of its N bundles, which starts the engine's other tensor-parallel ranks
itself (spec_engine.distributed.launch); the other N - 1 bundles hold their devices. On GPUs that
actor sees its node's GPUs (Ray's RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, as slime sets it)
and its ranks take consecutive GPUs from its own (`rollout.engine_actor.engine_base_gpu`): the
placement orders the bundles by node and GPU and checks that each engine's are consecutive GPUs
of one node.
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

from rollout.engine_actor import NOSET_CUDA_VISIBLE_DEVICES

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


def reserve_bundles(
    count: int, gpus_per_bundle: int, what: str, engine_span: int = 1
) -> ActorOptions:
    """Ray actor options, one per bundle of a new placement group of `count` bundles
    (`gpus_per_bundle` GPUs each, else one CPU each); `what` names the flags to change when the
    cluster is too small. With GPUs and `engine_span` > 1 the options come ordered by node and GPU
    (slime's order) and every `engine_span` consecutive ones must be consecutive GPUs of one
    node: an engine's ranks. The group lives as long as Ray does."""
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
    options = [
        dict(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i
            ),
        )
        for i in range(count)
    ]
    if gpus and engine_span > 1:
        options = _by_device(options, engine_span)
    return options


@ray.remote(num_cpus=0, num_gpus=0.01)
def _bundle_gpu() -> tuple[str, int]:
    """(node id, Ray's GPU id) of the bundle this task runs in."""
    return ray.get_runtime_context().get_node_id(), int(ray.get_gpu_ids()[0])


def _by_device(options: ActorOptions, span: int) -> ActorOptions:
    """`options` sorted by their bundles' (node, GPU), as slime orders them; raises unless each
    run of `span` is consecutive GPUs of one node (one engine's ranks, base_gpu_id + r)."""
    where = ray.get([_bundle_gpu.options(**_in_bundle(o)).remote() for o in options])
    order = sorted(range(len(options)), key=lambda i: where[i])
    for first in range(0, len(order) - span + 1, span):
        gpus = [where[i] for i in order[first : first + span]]
        nodes = {node for node, _ in gpus}
        ids = [gpu for _, gpu in gpus]
        if len(nodes) > 1 or ids != list(range(ids[0], ids[0] + span)):
            raise RuntimeError(
                f"engine {first // span}'s {span} GPUs are {ids} on {len(nodes)} node(s); an "
                "engine's ranks run on consecutive GPUs of one node (multi-node engines are not "
                "supported yet): lower --rollout-num-gpus-per-engine to at most the GPUs of a "
                "node, dividing them"
            )
    return [options[i] for i in order]


def _in_bundle(options: dict[str, Any]) -> dict[str, Any]:
    return {"scheduling_strategy": options["scheduling_strategy"]}


def create_placements(args: argparse.Namespace) -> Placements:
    """Bundles for the engines (none with --debug-train-only) and the trainer ranks (none with
    --debug-rollout-only), from the launcher's flags: one per device, each engine's actor in the
    first of its --rollout-num-gpus-per-engine bundles. With --colocate both share one set of
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
            per_engine,
        )
        trainer = [share(shared[i], COLOCATED_TRAINER_SHARE) for i in range(num_ranks)]
        engines = [share(o, COLOCATED_ENGINE_SHARE) for o in shared]
        return Placements(engine_actors(engines, per_engine, num_engines), trainer)
    if num_engines:
        bundles = reserve_bundles(args.rollout_num_gpus, 1, "--rollout-num-gpus", per_engine)
        engines = engine_actors(bundles, per_engine, num_engines)
    if num_ranks:
        trainer = reserve_bundles(num_ranks, 1, "--actor-num-nodes x --actor-num-gpus-per-node")
    return Placements(engines, trainer)


def engine_actors(bundles: ActorOptions, per_engine: int, count: int) -> ActorOptions:
    """The options of `count` engine actors, each in the first of its `per_engine` bundles; a
    multi-GPU engine's actor sees the node's GPUs (its ranks use the next bundles' GPUs)."""
    engines = [bundles[i * per_engine] for i in range(count)]
    if per_engine > 1:
        env = {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}
        engines = [{**o, "runtime_env": env} if o["num_gpus"] else o for o in engines]
    return engines


def share(options: dict[str, Any], fraction: float) -> dict[str, Any]:
    """The actor options of a bundle, taking `fraction` of its device (and CPU)."""
    resource = "num_gpus" if options["num_gpus"] else "num_cpus"
    return {**options, "num_cpus": 0, "num_gpus": 0, resource: options[resource] * fraction}
