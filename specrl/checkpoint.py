"""The run's checkpoints (--save / --load / --start-rollout-id): where they are, what they hold
beside the policy, and the checks made before Ray starts.

Layout, as Megatron-LM and slime write it:

    SAVE/iter_{N:07d}/                       the checkpoint after rollout N (N = rollout id)
        common.pt, .metadata, __*_*.distcp   the policy (model, optimizer, RNG), written by
        metadata.json                        megatron-core's dist_checkpointing on every rank
                                             (trainer_bridge.checkpoint)
        rollout_state.json                   the launcher's state (ROLLOUT_STATE)
    SAVE/latest_checkpointed_iteration.txt   N of the newest complete checkpoint, written last

A checkpoint is written into `iter_{N:07d}.partial/`, renamed once complete, and only then named
by the latest file (temp file, fsync, rename): a save killed at any moment leaves the previous
checkpoint loadable, and a `.partial` directory is never read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer_bridge.checkpoint import (
    check_common,
    check_megatron_model,
    check_same_model,
    read_common,
)
from trainer_bridge.convert.checkpoint import META_FILE as MCORE_META_FILE
from trainer_bridge.convert.checkpoint import read_mcore_meta

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
ROLLOUT_STATE = "rollout_state.json"
PARTIAL = ".partial"
# dist_checkpointing's files besides the shards: without them the checkpoint is partial.
MEGATRON_FILES = ("common.pt", ".metadata", "metadata.json")


def iter_dir(root: str, rollout_id: int) -> str:
    return os.path.join(root, f"iter_{rollout_id:07d}")


@dataclass(frozen=True)
class Resume:
    """A checkpoint to resume from: its directory, rollout id and the launcher's state."""

    directory: str
    rollout_id: int
    state: dict[str, Any]


def new_run_state(weight_version: int, rollout: dict[str, Any], wandb_run_id: str) -> dict:
    """What the launcher keeps beside the policy: the engines' weight version, the rollout
    manager's position (data source epoch/offset/shuffle, sample numbering) and the wandb run."""
    return {"weight_version": weight_version, "rollout": rollout, "wandb_run_id": wandb_run_id}


def new_wandb_run_id() -> str:
    return uuid.uuid4().hex[:8]  # wandb's own id shape: 8 lowercase alphanumerics


def save(root: str, rollout_id: int, write_policy: Callable[[str], None], state: dict) -> str:
    """Write checkpoint `rollout_id` under `root` and make it the latest; returns its directory.
    `write_policy(directory)` has every trainer rank write its shards there."""
    final = iter_dir(root, rollout_id)
    partial = final + PARTIAL
    shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
    os.makedirs(partial)
    write_policy(partial)
    _write_durably(os.path.join(partial, ROLLOUT_STATE), json.dumps(state, indent=1))
    if os.path.exists(final):
        # Only when a run restarted before this id (--start-rollout-id) saves it again: the
        # latest file may name it for the instant between these two calls.
        shutil.rmtree(final)
    os.rename(partial, final)
    _fsync_dir(root)
    _write_durably(os.path.join(root, LATEST_FILE), str(rollout_id))
    return final


def _write_durably(path: str, text: str) -> None:
    """`path` holds `text` or what it held before, never a part: temp file, fsync, rename."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_tracker(root: str) -> str | None:
    """What `root`'s latest file names (a rollout id, or Megatron-LM's 'release'), None without
    one."""
    path = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def read_latest(root: str) -> int | None:
    """The rollout id named by `root`'s latest file, None without one."""
    text = read_tracker(root)
    if text is None:
        return None
    path = os.path.join(root, LATEST_FILE)
    if not text.isdigit():
        raise ValueError(
            f"{path} holds {text!r}, not a rollout id; it was not written by --save (Megatron's "
            "'release' checkpoints are not resumable): point --load at a --save directory, and "
            "start from a release checkpoint (slime's torch_dist) with --ref-load"
        )
    return int(text)


def check_complete(
    directory: str, files: tuple[str, ...] = (*MEGATRON_FILES, ROLLOUT_STATE)
) -> None:
    """Refuse a checkpoint directory that lacks one of `files` or whose shards are cut short
    (every shard file named in dist_checkpointing's .metadata must hold the bytes it lists)."""
    from torch.distributed.checkpoint import FileSystemReader

    for name in files:
        if not os.path.isfile(os.path.join(directory, name)):
            raise ValueError(
                f"{directory} is incomplete (no {name}); delete it, and its number from "
                f"{LATEST_FILE} if it is named there, to resume from an earlier checkpoint"
            )
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as e:  # a truncated pickle: the message names the file
        raise ValueError(
            f"{directory}/.metadata cannot be read ({e}); the checkpoint is corrupt"
        ) from e
    needed: dict[str, int] = {}
    for item in metadata.storage_data.values():
        end = item.offset + item.length
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        path = os.path.join(directory, name)
        have = os.path.getsize(path) if os.path.isfile(path) else None
        if have is None or have < size:
            raise ValueError(
                f"{path} is {'missing' if have is None else f'cut short ({have} of {size} bytes)'}"
                "; the checkpoint is corrupt: restore it, or resume from an earlier one"
            )


def resolve(args: argparse.Namespace, hf_config: dict[str, Any]) -> Resume | None:
    """Check --output-dir, --save, --save-hf and --load before anything starts; returns the
    checkpoint to resume from (None: start from --hf-checkpoint). Raises SystemExit naming the
    path and what to do. With --dry-run nothing is created."""
    try:
        for flag, directory in (
            ("--output-dir", args.output_dir),
            ("--save", args.save),
            ("--save-hf", args.save_hf and _static_dir(args.save_hf)),
        ):
            if directory:
                check_writable(directory, flag, create=not args.dry_run)
        if args.ref_load is not None:
            trainer = dataclasses.replace(
                args.options.trainer,
                ref_load=resolve_ref_load(args, hf_config),
            )
            args.options = args.options._replace(trainer=trainer)
        return _find_resume(args, hf_config)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def resolve_ref_load(args: argparse.Namespace, hf_config: dict[str, Any]) -> str:
    """--ref-load (the weights a run with nothing to resume starts from, and the KL reference,
    as in slime) as the directory the trainer reads: the latest complete checkpoint of a --save
    directory, one iter_NNNNNNN/ directory, a Megatron-LM checkpoint (slime's torch_dist: its
    tools/convert_hf_to_torch_dist.py output, whose latest file says 'release', or its --save's),
    the megatron checkpoint `trainer_bridge.convert hf-to-mcore` writes, or a Hugging Face
    checkpoint of the same model."""
    path = args.ref_load
    if not os.path.isdir(path):
        raise ValueError(f"--ref-load {path} is not a directory")
    tracker = read_tracker(path)
    if tracker == "release":  # Megatron-LM's name for a checkpoint of no training iteration
        directory = os.path.join(path, "release")
    else:
        latest = read_latest(path)
        directory = iter_dir(path, latest) if latest is not None else path
    if os.path.isfile(os.path.join(directory, MEGATRON_FILES[0])):
        common = read_common(directory, megatron_lm=True)
        if common is not None:
            check_complete(directory)
            check_common(common, hf_config, directory)
        else:  # Megatron-LM's: the model's tensors under the same keys as ours
            check_complete(directory, MEGATRON_FILES)
            check_megatron_model(directory, hf_config)
        return directory
    if os.path.isfile(os.path.join(path, MCORE_META_FILE)):
        # `python -m trainer_bridge.convert hf-to-mcore` output, at any TP / EP size
        check_same_model(
            read_mcore_meta(path)["hf_config"],
            hf_config,
            path,
            "convert the policy's own Hugging Face checkpoint with hf-to-mcore",
        )
        return path
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ValueError(
            f"--ref-load {path} is neither a --save directory, a checkpoint of one, a "
            "Megatron-LM (slime torch_dist) checkpoint, a `trainer_bridge.convert hf-to-mcore` "
            "output, nor a Hugging Face checkpoint (no config.json); point it at one of these"
        )
    with open(config) as f:
        check_same_model(
            json.load(f), hf_config, path, "give a Hugging Face checkpoint of the policy's model"
        )
    return path


def check_writable(directory: str, flag: str, create: bool = True) -> None:
    """Create `directory` and a file in it (as root, permission bits alone prove nothing); with
    `create` False, only check that its nearest existing ancestor is a writable directory."""
    try:
        if create:
            os.makedirs(directory, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
            return
        existing = os.path.abspath(directory)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
            raise NotADirectoryError(f"{existing} is not a writable directory")
    except OSError as e:
        raise ValueError(
            f"{flag} {directory} is not writable ({e.strerror or e}); give a directory this user "
            "can create and write"
        ) from None


def _static_dir(template: str) -> str:
    """The directory part of a --save-hf template before its first {placeholder}."""
    if "{" not in template:
        return template
    return os.path.dirname(template.split("{", 1)[0]) or "."


def _find_resume(args: argparse.Namespace, hf_config: dict[str, Any]) -> Resume | None:
    if args.load is None:
        return None
    latest = read_latest(args.load) if os.path.isdir(args.load) else None
    if latest is None:
        same = args.save is not None and os.path.realpath(args.save) == os.path.realpath(args.load)
        # slime's `--load $SAVE --save $SAVE`: the first run has nothing to resume yet; and with
        # --ref-load, slime starts from it whatever --load holds
        if same or args.ref_load is not None:
            start = "--hf-checkpoint" if args.ref_load is None else f"--ref-load {args.ref_load}"
            logger.info("no checkpoint in %s yet: starting from %s", args.load, start)
            return None
        raise ValueError(
            f"--load {args.load} holds no checkpoint (no {LATEST_FILE}); give the --save "
            "directory of an earlier run, or leave --load out to start from --hf-checkpoint "
            "(or from --ref-load's weights, as slime does)"
        )
    directory = iter_dir(args.load, latest)
    if not os.path.isdir(directory):
        raise ValueError(
            f"{os.path.join(args.load, LATEST_FILE)} names rollout {latest}, but {directory} is "
            "missing; restore it, or write the id of a checkpoint that exists into that file"
        )
    # slime's --save (or a conversion) has no rollout state: tell it apart from a specrl
    # checkpoint cut short before check_complete calls it incomplete
    megatron_lm = (
        not os.path.isfile(os.path.join(directory, ROLLOUT_STATE))
        and os.path.isfile(os.path.join(directory, MEGATRON_FILES[0]))
        and read_common(directory, megatron_lm=True) is None
    )
    if megatron_lm:
        raise ValueError(
            f"--load {args.load} holds a Megatron-LM checkpoint ({directory}: slime's --save), "
            "not a specrl one: specrl resumes its own checkpoints (the rollout position, Adam's "
            "state per parameter), and does not read megatron's distributed-optimizer state. "
            f"Start from its weights with --ref-load {args.load} (the policy and the KL "
            "reference start there, the optimizer and the prompt order afresh) and --load/--save "
            "a new directory"
        )
    check_complete(directory)
    common = read_common(directory)
    check_common(common, hf_config, directory)
    with open(os.path.join(directory, ROLLOUT_STATE)) as f:
        state = json.load(f)
    return Resume(directory, latest, state)
