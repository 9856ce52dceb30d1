"""The policy's training checkpoint as megatron-core writes it: `dist_checkpointing` (torch_dist
backend), one directory per checkpoint, every rank writing its own shards.

The state dict follows Megatron-LM's `generate_state_dict` (megatron/training/checkpointing.py,
which megatron-core does not ship): `model` (the GPTModel, MTP layers included), `optimizer`
(Adam's moments and step, sharded like the parameters), `rng_state` (every rank's Python, NumPy,
torch and tracker states: one object per tensor-parallel rank holding the list of its
data-parallel replicas' states), `iteration` (the rollout id, as in slime), `checkpoint_version`,
and specrl's own `specrl` entry (the model's Hugging Face config, the tensor-, expert- and expert
tensor parallel sizes and the optimizer step count), which the launcher reads back without
megatron (`read_common`) to refuse a checkpoint of another model before anything starts. Every
tensor, Adam's moments included, is saved as megatron's sharded tensor of its parameter (global
shape, this rank's offsets), so a checkpoint resumes at another tensor-parallel size too:
dist_checkpointing reads each rank's slices of it (the vocabulary padded for another TP size:
megatron's `allow_shape_mismatch`, the padding rows zero). Under expert parallelism each rank
writes its own experts under their global numbers (megatron's SequentialMLP.sharded_state_dict),
their Adam state too, each expert's tensor sharded over the expert tensor parallel ranks (whole at
--expert-tensor-parallel-size 1): a checkpoint resumes at another expert-parallel and expert
tensor parallel size, each rank reading its experts (or its slices of them) back. With
--enable-draft-training, `draft` holds the draft trained online (EAGLE-2/3 or STANDALONE) and its
Adam state (trainer_bridge.drafts.online).

The modules, by job:
    layout.py       what a checkpoint holds: the state dict above, the RNG states
    optimizer.py    Adam's state in it, and back into the optimizer
    save.py         writing one (synchronously: no writer process)
    load.py         resuming from one; --ref-load's model weights from one or from Megatron-LM's
    common.py       common.pt, read without megatron: the launcher's checks before a run starts
    megatron_lm.py  the model shape of a Megatron-LM (slime) checkpoint, from its tensors' shapes
"""

from trainer_bridge.checkpoint.common import (
    COMMON_FILE,
    FORMAT,
    V1_FORMAT,
    check_common,
    check_same_model,
    read_common,
)
from trainer_bridge.checkpoint.load import load_checkpoint, load_reference
from trainer_bridge.checkpoint.megatron_lm import check_megatron_model
from trainer_bridge.checkpoint.save import save_checkpoint

__all__ = [
    "COMMON_FILE",
    "FORMAT",
    "V1_FORMAT",
    "check_common",
    "check_megatron_model",
    "check_same_model",
    "load_checkpoint",
    "load_reference",
    "read_common",
    "save_checkpoint",
]
