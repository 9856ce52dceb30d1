"""TrainGroup: the trainer as `num_ranks` TrainActor Ray actors forming one megatron group
(tensor parallel ranks adjacent, data parallel across groups), one GPU each, else one CPU each.

Every call goes to every rank (megatron's collectives need them all) and the result of rank 0
comes back, as in slime's RayTrainGroup.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from trainer_bridge.actor import TrainActor, TrainBatch, TrainerArgs
from trainer_bridge.loss import LossConfig
from trainer_bridge.weight_sync import WeightSyncConfig


PLACEMENT_TIMEOUT_S = 120


def reserve_bundles(count: int, gpus_per_bundle: int, what: str) -> tuple[Any, list[dict[str, Any]]]:
    """A Ray placement group of `count` bundles (`gpus_per_bundle` GPUs each, else one CPU each)
    and the actor options that pin one actor to each bundle; `what` names the flags to change
    when the cluster is too small."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpus = ray.cluster_resources().get("GPU", 0) > 0
    bundle = {"GPU": gpus_per_bundle, "CPU": 1} if gpus else {"CPU": 1}
    group = placement_group([bundle] * count)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"Ray could not place {count} x {bundle} within {PLACEMENT_TIMEOUT_S} s (cluster: "
                           f"{ray.cluster_resources()}); lower {what} or add resources (--ray-num-cpus on CPU)") from None
    options = [dict(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                         placement_group_bundle_index=i))
               for i in range(count)]
    return group, options


def _address_and_port() -> tuple[str, int]:
    import ray

    from trainer_bridge.megatron_compat import free_port

    return ray.util.get_node_ip_address(), free_port()


class TrainGroup:
    def __init__(self, args: TrainerArgs, loss_cfg: LossConfig, temperature: float, num_ranks: int) -> None:
        import ray

        if num_ranks % args.tensor_model_parallel_size:
            raise ValueError(f"{num_ranks} trainer ranks (--actor-num-nodes x --actor-num-gpus-per-node) are not a "
                             f"multiple of --tensor-model-parallel-size {args.tensor_model_parallel_size}")
        self.placement, options = reserve_bundles(num_ranks, 1, "--actor-num-nodes x --actor-num-gpus-per-node")
        # The rendezvous address must be rank 0's node: ask from inside its bundle.
        first = options[0]["scheduling_strategy"]
        address, port = ray.get(ray.remote(_address_and_port).options(num_cpus=0, scheduling_strategy=first).remote())
        self.actors = [ray.remote(TrainActor).options(**options[rank]).remote(
            args, loss_cfg, temperature, rank, num_ranks, address, port) for rank in range(num_ranks)]
        ray.get([a.ready.remote() for a in self.actors])

    def _all(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get([getattr(a, method).remote(*args) for a in self.actors])[0]

    def train(self, batch: TrainBatch) -> dict[str, float]:
        return self._all("train", batch)

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        return self._all("train_sft", batch)

    def push_weights(self, engines: Sequence[Any], cfg: WeightSyncConfig, version: str,
                     output_dir: Optional[str] = None) -> dict[str, float]:
        return self._all("push_weights", engines, cfg, version, output_dir)

    def save_hf(self, path: str) -> None:
        self._all("save_hf", path)

    def shutdown(self) -> None:
        """End the rank actors and give their placement group back."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement)
