"""TrainGroup: the trainer as TrainActor Ray actors forming one megatron group (tensor parallel
ranks adjacent, data parallel across groups), one rank per placement bundle.

The caller reserves the bundles (specrl.placement.reserve_bundles: one GPU each, else one CPU
each) and passes the Ray actor options that pin one rank to each. Every call goes to every rank
(megatron's collectives need them all) and the result of rank 0 comes back, as in slime's
RayTrainGroup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainer_bridge.actor.train_actor import TrainActor
from trainer_bridge.batch import TrainBatch
from trainer_bridge.loss import LossConfig
from trainer_bridge.options import TrainerArgs
from trainer_bridge.weight_sync import WeightSyncConfig


class TrainerDied(Exception):
    """A trainer rank's process is gone: the megatron group cannot go on without it."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"trainer rank {rank} died ({reason})")
        self.rank = rank


def _address_and_port() -> tuple[str, int]:
    import ray

    from trainer_bridge.megatron_compat import free_port

    return ray.util.get_node_ip_address(), free_port()


def _first_line(error: BaseException) -> str:
    """Ray's "The actor is dead because ..." line when there is one, else the first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    because = [line for line in lines if line.startswith("The actor is dead because")]
    return (because or lines or [type(error).__name__])[0][:300]


class TrainGroup:
    def __init__(
        self,
        args: TrainerArgs,
        loss_cfg: LossConfig,
        temperature: float,
        placement: Sequence[dict[str, Any]],
    ) -> None:
        """`placement`: Ray actor options, one per rank, each pinning the rank to its bundle."""
        import ray

        num_ranks = len(placement)
        if num_ranks % args.tensor_model_parallel_size:
            raise ValueError(
                f"{num_ranks} trainer ranks (--actor-num-nodes x --actor-num-gpus-per-node) are "
                f"not a multiple of --tensor-model-parallel-size {args.tensor_model_parallel_size}"
            )
        # The rendezvous address must be rank 0's node: ask from inside its bundle.
        first = placement[0]["scheduling_strategy"]
        address, port = ray.get(
            ray.remote(_address_and_port).options(num_cpus=0, scheduling_strategy=first).remote()
        )
        self.actors = [
            ray.remote(TrainActor)
            .options(**placement[rank])
            .remote(args, loss_cfg, temperature, rank, num_ranks, address, port)
            for rank in range(num_ranks)
        ]
        ray.get([a.ready.remote() for a in self.actors])

    def _all(self, method: str, *args: Any) -> Any:
        return self._wait([getattr(a, method).remote(*args) for a in self.actors])

    def _wait(self, refs: list[Any]) -> Any:
        """Rank 0's result of one call on every rank. Results are taken as they come, so a rank
        that died is reported at once, not after the others time out waiting for it in a
        collective."""
        import ray

        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except ray.exceptions.RayTaskError:
                raise  # the call failed inside a live rank (it may wrap an engine's death)
            except ray.exceptions.RayActorError as e:
                raise TrainerDied(refs.index(ready[0]), _first_line(e)) from e
        return ray.get(refs[0])

    def train(self, batch: TrainBatch) -> dict[str, float]:
        return self._all("train", batch)

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        return self._all("train_sft", batch)

    def push_weights(
        self,
        engines: Sequence[Any],
        cfg: WeightSyncConfig,
        version: str,
        output_dir: str | None = None,
        colocated: bool = False,
    ) -> dict[str, float]:
        """Rank 0 pushes (the other ranks of its TP group take part in the gathers);
        `colocated`: the engines share the trainer's devices (--colocate)."""
        return self._all("push_weights", engines, cfg, version, output_dir, colocated)

    def save_hf(self, path: str) -> None:
        self._all("save_hf", path)

    def save_checkpoint(self, directory: str, rollout_id: int) -> None:
        """Every rank writes its shards into `directory` (megatron's dist_checkpointing)."""
        self._all("save_checkpoint", directory, rollout_id)

    def load_checkpoint(self, directory: str) -> int:
        """Every rank restores its shards; returns the checkpoint's rollout id."""
        return self._all("load_checkpoint", directory)

    def shutdown(self) -> None:
        """End the rank actors (their bundles stay with the placement group's owner)."""
        import ray

        for actor in self.actors:
            ray.kill(actor)
