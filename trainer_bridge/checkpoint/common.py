"""A checkpoint's common.pt (dist_checkpointing's non-sharded entries), read without megatron: the
launcher checks a --load or --ref-load directory with it before anything starts, refusing a
checkpoint of another model shape or one this version cannot read, and saying what to do."""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

import torch

COMMON_FILE = "common.pt"  # where dist_checkpointing keeps the non-sharded entries
FORMAT = "specrl-torch_dist-v2"
# v1 kept megatron's own optimizer layout: at EP 1 the same tensor keys and step as v2's, at EP > 1
# under the `chained_N.` prefixes of megatron's ChainedOptimizer, which v2 does not read.
V1_FORMAT = "specrl-torch_dist-v1"


def _load_common(directory: str) -> Any:
    """common.pt's entries. Megatron-LM's hold its args (a Namespace) and enums, which torch's
    weights-only loading refuses until megatron.core registers them (on import), so a checkpoint
    of specrl's is read without importing megatron, and megatron is imported only when the first
    read refuses. A file that cannot be read either way (cut short) is named as corrupt."""
    path = os.path.join(directory, COMMON_FILE)
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            import megatron.core  # noqa: F401

            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated file: the message names it
        raise ValueError(f"{path} cannot be read ({e}); the checkpoint is corrupt") from e


def read_common(directory: str, megatron_lm: bool = False) -> dict[str, Any] | None:
    """The non-sharded entries of a checkpoint (iteration, specrl's metadata). Raises ValueError
    naming the directory when it is not one of these checkpoints; with `megatron_lm`, one written
    by Megatron-LM (slime's --save or torch_dist conversion: no specrl entry) gives None."""
    path = os.path.join(directory, COMMON_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"{directory} is not a complete megatron checkpoint (no {COMMON_FILE}): it was cut "
            "short or is not a checkpoint; point --load at a directory with "
            "latest_checkpointed_iteration.txt, or remove it"
        )
    common = _load_common(directory)
    meta = common.get("specrl") if isinstance(common, dict) else None
    if megatron_lm and meta is None:
        return None
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, V1_FORMAT):
        raise ValueError(
            f"{directory} was not written by specrl's --save (no {FORMAT!r} entry in "
            f"{COMMON_FILE}); a Megatron-LM (slime) checkpoint is read as --ref-load only: start "
            "from its Hugging Face export with --hf-checkpoint instead"
        )
    return common


def check_same_model(
    saved_config: dict[str, Any], hf_config: dict[str, Any], directory: str, fix: str
) -> None:
    """Refuse weights (Hugging Face config `saved_config`, in `directory`) of another model shape
    than --hf-checkpoint's `hf_config`, naming what differs and `fix`."""
    from trainer_bridge.model.provider import read_model_config

    saved, wanted = read_model_config(saved_config), read_model_config(hf_config)
    if saved != wanted:
        diffs = [
            f"{f.name} {getattr(saved, f.name)} vs {getattr(wanted, f.name)}"
            for f in dataclasses.fields(saved)
            if f.compare and getattr(saved, f.name) != getattr(wanted, f.name)
        ]
        raise ValueError(
            f"{directory} holds another model than --hf-checkpoint ({', '.join(diffs)}); {fix}"
        )


def check_common(common: dict[str, Any], hf_config: dict[str, Any], directory: str) -> None:
    """Refuse a checkpoint of another model shape, or one this version cannot read, saying what
    to do (any tensor-, expert- and expert tensor parallel size resumes)."""
    meta = common["specrl"]
    check_same_model(
        meta["hf_config"],
        hf_config,
        directory,
        "pass the --hf-checkpoint the run started from, or a checkpoint of this model",
    )
    saved_ep = meta.get("expert_model_parallel_size", 1)  # 1 from before EP
    if meta["format"] == V1_FORMAT and saved_ep > 1:
        raise ValueError(
            f"{directory} was written by an older specrl ({V1_FORMAT}) at "
            f"--expert-model-parallel-size {saved_ep}, whose Adam state is laid out per "
            "expert-parallel size (megatron's chained optimizers), which this version does not "
            "read: resume it with the specrl that wrote it, or start a new run from its Hugging "
            "Face export (--save-hf) as --hf-checkpoint"
        )
