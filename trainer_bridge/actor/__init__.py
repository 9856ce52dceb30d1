"""The trainer's ranks: one rank (TrainActor, train_actor.py), and the ranks of one megatron group
as Ray actors (TrainGroup, group.py)."""

from trainer_bridge.actor.group import TrainerDied, TrainGroup
from trainer_bridge.actor.train_actor import TrainActor

__all__ = ["TrainActor", "TrainGroup", "TrainerDied"]
