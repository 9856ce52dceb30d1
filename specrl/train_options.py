"""scripts/train.py's flags: the packages' options (trainer, rollout, engine as --sglang-*) plus
the launcher's own, parsed and validated before anything starts.

`parse_args(argv)` returns the argparse namespace with `.options`, each package's options class
built (and so validated) once.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from rollout import config as rollout_config
from rollout.config import RolloutArgs
from spec_engine.args import engine_args as engine_config
from spec_engine.args.dataclass_cli import HelpFormatter, add_dataclass_args, dataclass_from_args
from spec_engine.args.engine_args import EngineArgs
from spec_engine.args.resolve import resolve_engine_config
from spec_engine.models.hf_config import ModelConfig
from specrl.slime_compat import SlimeCompatArgs, check_model_shape, check_slime_options
from trainer_bridge.loss import LossConfig
from trainer_bridge.model.moe import balance_config
from trainer_bridge.model.provider import check_tensor_parallel, read_model_config
from trainer_bridge.options import TrainerArgs, check_mtp_flags
from trainer_bridge.parallel.expert import check_expert_parallel
from trainer_bridge.routing_replay import check_routing_replay
from trainer_bridge.weight_sync import WeightSyncConfig

ENGINE_PREFIX = "sglang-"
NOT_A_SERVER = "the launcher (engines are Ray actors, not servers)"
# Engine flags the launcher sets itself, and the launcher flag that controls each.
LAUNCHER_OWNED = {
    "model_path": "--hf-checkpoint",
    "tokenizer_path": "--hf-checkpoint",
    "random_seed": "--seed",
    "host": NOT_A_SERVER,
    "port": NOT_A_SERVER,
    "api_key": NOT_A_SERVER,
    "skip_server_warmup": "the launcher",
    "weight_version": "the launcher (it counts weight updates)",
    "skip_tokenizer_init": "the launcher (rewards need text)",
    "tp_size": "--rollout-num-gpus-per-engine",
    "dist_init_addr": "the launcher (engines are placed by Ray)",
    "base_gpu_id": "the launcher (engines are placed by Ray)",
}
# SGLang flags specrl's engine does not have, and what does their job here.
SGLANG_ONLY = {
    "enable_memory_saver": "--colocate",
    "dp_size": "--rollout-num-gpus (one engine per device)",
}
# slime's own --sglang-* launcher flags, and why specrl needs none.
SLIME_SGLANG = {
    "router_ip": "requests are routed in-process (rollout.router), no external router",
    "router_port": "requests are routed in-process (rollout.router), no external router",
    "server_concurrency": "each engine takes --sglang-max-running-requests requests at once",
}
USAGE = (
    "python -m scripts.train --hf-checkpoint DIR --rollout-batch-size N --num-rollout N "
    "--output-dir DIR [flags]"
)
DESCRIPTION = """\
The RL loop: rollout -> samples -> train -> weight update -> next rollout.

Flags come from the packages: trainer (TrainerArgs, LossConfig, WeightSyncConfig), rollout
(RolloutArgs), engine (spec_engine's EngineArgs as --sglang-<flag>), then the launcher's own.
Every flag also accepts its underscore spelling (--rollout_batch_size)."""


def _opt(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class LauncherArgs:
    """The flags that belong to no package: run length, output, devices, debug modes, logging."""

    num_rollout: int = field(metadata={"help": "Rollouts (RL steps) to run."})
    output_dir: str = field(
        metadata={"help": "Where metrics.jsonl, plots and logs go.", "metavar": "DIR"}
    )
    save: str | None = _opt(
        None,
        "Save a training checkpoint here every --save-interval rollouts and after the last one, "
        "as Megatron-LM/slime lay it out: DIR/iter_{N:07d}/ (the policy through megatron-core's "
        "dist_checkpointing: model, MTP layers, optimizer, every rank's RNG; plus the rollout "
        "id, weight version and prompt position) and DIR/latest_checkpointed_iteration.txt.",
        metavar="DIR",
        unset="none: no checkpoints",
    )
    save_interval: int | None = _opt(
        None,
        "Rollouts between checkpoints (--save and --save-hf; the last rollout is always saved).",
        unset="none: the last rollout only",
    )
    load: str | None = _opt(
        None,
        "Resume from the latest checkpoint in this --save directory (slime's `--load $SAVE "
        "--save $SAVE`: rerunning the same command resumes; with nothing saved there yet the run "
        "starts from --hf-checkpoint).",
        metavar="DIR",
        unset="none: start from --hf-checkpoint",
    )
    start_rollout_id: int | None = _opt(
        None, "First rollout id to run.", unset="0, or the one after the --load checkpoint"
    )
    save_hf: str | None = _opt(
        None,
        "Also write a Hugging Face checkpoint (loadable by transformers and the engine) at every "
        "save; {rollout_id} is filled in.",
        metavar="PATH",
        unset="none: not written",
    )
    rollout_num_gpus: int = _opt(1, "Devices (CPU bundles without GPUs) for all engines together.")
    rollout_num_gpus_per_engine: int = _opt(
        1,
        "Devices per engine (slime's flag): engines = --rollout-num-gpus / this, each one Ray "
        "actor that runs its engine at --tp-size this, on consecutive devices of one node.",
    )
    actor_num_nodes: int = _opt(1, "Nodes of trainer ranks.")
    actor_num_gpus_per_node: int = _opt(
        1,
        "Trainer ranks per node (one GPU each; CPUs without GPUs); TP groups come from "
        "--tensor-model-parallel-size, the rest is data parallel.",
    )
    colocate: bool = _opt(
        False,
        "Trainer and engines share the same devices (slime's colocation: one GPU is enough): "
        "engines release weights and KV while the trainer runs, and weights are pushed by CUDA "
        "IPC (--weight-sync-mode tensor).",
    )
    update_weights_interval: int = _opt(
        1,
        "scripts/train_async.py (slime's flag): push the weights to the engines after every N "
        "train steps; a rollout is then generated by weights at most N steps older than the "
        "policy that trains on it (the bound on rollout/weight_version_lag). scripts/train.py "
        "pushes after every step and takes 1 only.",
    )
    debug_rollout_only: bool = _opt(
        False, "Rollouts only: no trainer, no training, no weight update."
    )
    debug_train_only: bool = _opt(False, "Training only, on --load-debug-rollout-data: no engines.")
    use_wandb: bool = _opt(False, "Log to wandb (offline unless WANDB_MODE is set).")
    wandb_project: str | None = _opt(None, "wandb project.", unset="specrl")
    use_tensorboard: bool = _opt(False, "Log to tensorboard under --output-dir.")
    use_fault_tolerance: bool = _opt(
        False,
        "Restart an engine that dies during a rollout or an evaluation (slime's flag): a fresh "
        "engine in the same bundle is given the policy's current weights and version, and the "
        "requests the dead one held are sent again (same rid, params and seed). Without it, or "
        "past --max-engine-restarts, a dead engine ends the run, naming the last checkpoint. A "
        "dead trainer rank always ends the run.",
    )
    max_engine_restarts: int = _opt(
        3,
        "Most engine restarts over the whole run with --use-fault-tolerance (a resumed run "
        "counts afresh); the next engine death ends the run.",
    )
    rollout_health_check_interval: float = _opt(
        30.0,
        "With --use-fault-tolerance, seconds between health checks of every engine during a "
        "rollout (a one-token generation, SGLang's /health_generate; slime's flag).",
    )
    rollout_health_check_timeout: float = _opt(
        30.0,
        "Seconds an engine has to answer a health check; past it the engine is taken as hung, "
        "killed and restarted (slime's flag).",
    )
    rollout_health_check_first_wait: float = _opt(
        300.0,
        "Seconds after start before the first health check (slime's flag: time for a large "
        "model's first requests to compile).",
    )
    dry_run: bool = _opt(False, "Check the flags, print the resolved options and exit.")
    ray_num_cpus: int | None = _opt(None, "CPUs of the local Ray.", unset="all")
    num_steps_per_rollout: int | None = _opt(
        None,
        "Optimizer steps per rollout (slime's flag): sets --global-batch-size to "
        "--rollout-batch-size x --n-samples-per-prompt / N.",
        unset="none: --global-batch-size decides",
    )


class Options(NamedTuple):
    """Each package's options, built (and validated) once from the flags."""

    trainer: TrainerArgs
    loss: LossConfig
    sync: WeightSyncConfig
    rollout: RolloutArgs
    engine: EngineArgs


def build_parser(command: str = "train") -> argparse.ArgumentParser:
    """The flags of scripts/<command>.py (train, or train_async: the same flags)."""
    parser = argparse.ArgumentParser(
        prog=f"scripts/{command}.py",
        usage=USAGE.replace("scripts.train", f"scripts.{command}"),
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    add_dataclass_args(parser, TrainerArgs, "trainer (TrainerArgs)", required=["hf_checkpoint"])
    add_dataclass_args(parser, LossConfig, "trainer: policy loss (LossConfig)")
    add_dataclass_args(parser, WeightSyncConfig, "trainer: weight sync (WeightSyncConfig)")
    rollout_config.add_cli_args(parser)
    engine_config.add_cli_args(parser, prefix=ENGINE_PREFIX, exclude=LAUNCHER_OWNED)
    add_dataclass_args(parser, LauncherArgs, "launcher")
    add_dataclass_args(
        parser, SlimeCompatArgs, "slime / Megatron-LM flags for run scripts (no-ops or refused)"
    )
    return parser


def check_engine_flags(argv: Sequence[str]) -> None:
    """Refuse launcher-owned and unknown --sglang-* flags with a message naming the right one.
    A unique prefix of a flag counts as that flag (argparse's abbreviations, as in SGLang)."""
    known = sorted(set(engine_config.field_names()) | set(LAUNCHER_OWNED) | set(SLIME_SGLANG))
    for arg in argv:
        if not arg.startswith("--" + ENGINE_PREFIX) and not arg.startswith("--sglang_"):
            continue
        flag = arg.split("=", 1)[0]
        given = flag[2 + len(ENGINE_PREFIX) :].replace("-", "_")
        matches = [given] if given in known else [k for k in known if k.startswith(given)]
        if len(matches) > 1:
            options = ", ".join(f"--{ENGINE_PREFIX}{m.replace('_', '-')}" for m in matches)
            raise SystemExit(f"error: ambiguous engine flag {flag} could match {options}")
        name = matches[0] if matches else given
        if name in LAUNCHER_OWNED:
            raise SystemExit(
                f"error: {flag} is set by the launcher; use {LAUNCHER_OWNED[name]} instead"
            )
        if name in SLIME_SGLANG:
            raise SystemExit(f"error: {flag} (slime's) is not supported: {SLIME_SGLANG[name]}")
        if name in SGLANG_ONLY:
            raise SystemExit(
                f"error: {flag} is not an engine flag in specrl; use {SGLANG_ONLY[name]}"
            )
        if not matches:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
            hint = f"; did you mean --{ENGINE_PREFIX}{close[0].replace('_', '-')}?" if close else ""
            raise SystemExit(f"error: unknown engine flag {flag}{hint}")


def parse_args(argv: Sequence[str] | None = None, command: str = "train") -> argparse.Namespace:
    """The flags, checked together; `.options` holds each package's validated options."""
    argv = list(sys.argv[1:] if argv is None else argv)
    check_engine_flags(argv)
    args = build_parser(command).parse_args(argv)
    if args.load_debug_rollout_data is not None:
        args.debug_train_only = True  # as in slime: saved rollouts need no engines
    check_launcher_flags(args)
    args.compat_notes = check_slime_options(args)
    if args.num_steps_per_rollout is not None:
        args.global_batch_size = steps_to_global_batch(args)
    check_draft_training(args)
    if args.use_rollout_routing_replay:  # as slime: the engines must report the routing
        args.sglang_enable_return_routed_experts = True
    try:  # every options class validates itself now, before any engine or trainer starts
        args.options = Options(
            dataclass_from_args(
                TrainerArgs,
                args,
                draft_checkpoint=args.sglang_speculative_draft_model_path,
                speculative_algorithm=args.sglang_speculative_algorithm,
            ),
            dataclass_from_args(LossConfig, args),
            dataclass_from_args(WeightSyncConfig, args),
            rollout_config.from_cli_args(args),
            engine_config.from_cli_args(
                args,
                prefix=ENGINE_PREFIX,
                model_path=args.hf_checkpoint,
                random_seed=args.seed,
                weight_version="0",
                tp_size=args.rollout_num_gpus_per_engine,
            ),
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return args


def check_checkpoints(args: argparse.Namespace) -> list[str]:
    """Read the checkpoints' configs and resolve the engine (the draft's config, the draft tree
    against SGLang's limits) before Ray starts; returns what was resolved, a line each.
    Raises SystemExit naming the flag to change."""
    try:
        target = ModelConfig.from_pretrained(args.hf_checkpoint)
        check_model_shape(args, target)
        check_mtp_flags(args, target.num_mtp_layers, target.architecture)
        if args.use_rollout_routing_replay:
            check_routing_replay(target, args.hf_checkpoint)
        if not args.debug_rollout_only:  # a model the trainer cannot build fails here, not in Ray
            try:
                read_model_config(target)
            except ValueError as e:
                raise ValueError(
                    f"{e} (--debug-rollout-only runs the rollouts without training)"
                ) from None
            balance_config(args, target)  # MoE only
            check_tensor_parallel(target, args.tensor_model_parallel_size)
            check_expert_parallel(
                target,
                args.expert_model_parallel_size,
                args.tensor_model_parallel_size,
                world_size=args.actor_num_nodes * args.actor_num_gpus_per_node,
                expert_tp=args.expert_tensor_parallel_size,
            )
        lines = [
            f"model: {args.hf_checkpoint} ({target.architecture}, {target.num_hidden_layers} "
            f"layers, {target.num_mtp_layers} MTP layers)"
        ]
        if args.debug_train_only:
            return lines
        config = resolve_engine_config(
            args.options.engine, cuda_available=torch.cuda.is_available()
        )
    except ValueError as e:
        per_engine = args.rollout_num_gpus_per_engine
        if per_engine > 1 and "--tp-size" in str(e):
            raise SystemExit(
                f"error: --rollout-num-gpus-per-engine {per_engine} runs each engine at --tp-size "
                f"{per_engine} (its flags given here as --sglang-<flag>): {e}"
            ) from None
        raise SystemExit(f"error: {e}") from None
    engine = config.args
    lines.append(
        f"engine: {engine.device} {engine.dtype}, {engine.attention_backend} attention, context "
        f"{config.context_len}"
    )
    if engine.speculative_algorithm is not None:
        draft = (
            f"draft {config.draft_kind.value}: {config.draft_checkpoint} "
            f"({config.draft.architecture}), "
            if config.draft_kind is not None
            else ""
        )
        lines.append(
            f"speculative {engine.speculative_algorithm}: {draft}steps "
            f"{engine.speculative_num_steps}, topk {engine.speculative_eagle_topk}, "
            f"{engine.speculative_num_draft_tokens} draft tokens"
        )
    return lines


def check_draft_training(args: argparse.Namespace) -> None:
    """--enable-draft-training trains the engines' external EAGLE-2, EAGLE-3 or STANDALONE draft:
    refuse the algorithms and flags it cannot go with yet, naming why and what trains instead."""
    if not args.enable_draft_training:
        return
    algorithm = (args.sglang_speculative_algorithm or "").upper()
    if algorithm == "NEXTN":  # SGLang's alias, as the engine reads it
        algorithm = "EAGLE"
    draft = args.sglang_speculative_draft_model_path
    why = None
    if algorithm == "EAGLE" and draft is None:
        why = (
            f"{args.sglang_speculative_algorithm} without --sglang-speculative-draft-model-path "
            "drafts with the model's MTP layers, which train with --enable-mtp-training"
        )
    elif algorithm == "STANDALONE" and draft is None:
        why = "it needs the draft LM"
    elif algorithm == "STANDALONE" and os.path.realpath(draft) == os.path.realpath(
        args.hf_checkpoint
    ):
        why = (
            "the draft is --hf-checkpoint itself, so the engines draft with the policy's own "
            "weights, which every push updates; drop the flag, or give a smaller draft LM"
        )
    elif algorithm == "NGRAM":
        why = "NGRAM drafts from an n-gram cache, with no model to train"
    elif algorithm not in ("EAGLE", "EAGLE3", "STANDALONE"):
        why = "no draft model runs"
    if why is not None:
        raise SystemExit(
            "error: --enable-draft-training trains an EAGLE-2, EAGLE-3 or STANDALONE draft, and "
            f"--sglang-speculative-algorithm is {args.sglang_speculative_algorithm}: {why}; give "
            "EAGLE, EAGLE3 or STANDALONE with its draft (--sglang-speculative-draft-model-path)"
        )
    if args.debug_rollout_only:
        raise SystemExit(
            "error: --enable-draft-training trains the draft in the trainer, and "
            "--debug-rollout-only has none; drop one of the two"
        )


def steps_to_global_batch(args: argparse.Namespace) -> int:
    """slime's --num-steps-per-rollout as the --global-batch-size it implies."""
    steps, samples = args.num_steps_per_rollout, args.rollout_batch_size * args.n_samples_per_prompt
    if steps <= 0 or samples % steps:
        raise SystemExit(
            f"error: --num-steps-per-rollout {steps} must be positive and divide the rollout's "
            f"{samples} samples (--rollout-batch-size x --n-samples-per-prompt)"
        )
    if args.global_batch_size is not None and args.global_batch_size != samples // steps:
        raise SystemExit(
            f"error: --num-steps-per-rollout {steps} means --global-batch-size {samples // steps}, "
            f"but --global-batch-size {args.global_batch_size} is given; give one of the two"
        )
    return samples // steps


def check_launcher_flags(args: argparse.Namespace) -> None:
    """Refuse launcher flags that contradict each other, naming the flags to change."""
    if args.debug_rollout_only and args.debug_train_only:
        raise SystemExit(
            "error: --debug-rollout-only and --debug-train-only (or "
            "--load-debug-rollout-data) exclude each other"
        )
    per_engine, devices = args.rollout_num_gpus_per_engine, args.rollout_num_gpus
    if per_engine < 1 or devices < per_engine or devices % per_engine:
        raise SystemExit(
            f"error: --rollout-num-gpus {devices} must be a positive multiple of "
            f"--rollout-num-gpus-per-engine {per_engine} (engines = the first / the second)"
        )
    if args.max_engine_restarts < 0:
        raise SystemExit(
            f"error: --max-engine-restarts must be >= 0, got {args.max_engine_restarts}"
        )
    for flag, least in (("interval", 0), ("timeout", 0), ("first_wait", None)):
        value = getattr(args, f"rollout_health_check_{flag}")
        if not (value > least if least is not None else value >= 0):
            raise SystemExit(
                f"error: --rollout-health-check-{flag.replace('_', '-')} must be "
                f"{'positive' if least is not None else '>= 0'}, got {value}"
            )
    if args.update_weights_interval < 1:
        raise SystemExit(
            f"error: --update-weights-interval must be >= 1, got {args.update_weights_interval}"
        )
    if args.save_interval is not None and args.save_interval <= 0:
        raise SystemExit(f"error: --save-interval must be positive, got {args.save_interval}")
    for flag in ("save", "save_hf", "load"):
        if args.debug_rollout_only and getattr(args, flag):
            raise SystemExit(
                f"error: --{flag.replace('_', '-')} saves or restores the trained policy, and "
                "--debug-rollout-only has no trainer"
            )
    if args.start_rollout_id is not None and not 0 <= args.start_rollout_id <= args.num_rollout:
        raise SystemExit(
            f"error: --start-rollout-id {args.start_rollout_id} is outside [0, --num-rollout "
            f"{args.num_rollout}]"
        )
    if args.bf16 and not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(
            "error: --bf16 needs CUDA (megatron's mixed-precision optimizer); train in "
            "float32 on CPU"
        )
    if args.debug_train_only and args.load_debug_rollout_data is None:
        raise SystemExit(
            "error: --debug-train-only trains on saved rollouts: give --load-debug-rollout-data"
        )
    if args.colocate and args.weight_sync_mode == "distributed":
        raise SystemExit(
            "error: --colocate puts trainer and engines on the same GPUs, where NCCL cannot "
            "broadcast between two ranks; use --weight-sync-mode tensor (CUDA IPC) with it"
        )
    if args.partial_rollout and args.use_rollout_routing_replay:
        raise SystemExit(
            "error: --partial-rollout continues responses in a later request, and "
            "--use-rollout-routing-replay needs each response's routing from one request; drop "
            "one of them"
        )
    if (args.eval_interval is None) != (args.eval_prompt_data is None):
        raise SystemExit(
            "error: --eval-interval and --eval-prompt-data go together (how often, and on what)"
        )
