"""The RL loop: rollout -> samples -> train -> weight update -> next rollout (slime's train.py shape).

    python -m scripts.train --hf-checkpoint M --prompt-data D.jsonl --rollout-batch-size 8 \\
        --n-samples-per-prompt 4 --rm-type tiny --num-rollout 10 --output-dir runs/x \\
        --sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 2

Flags come from the packages: trainer (trainer_bridge: TrainerArgs, LossConfig, WeightSyncConfig),
rollout (rollout.config.RolloutArgs), engine (spec_engine EngineArgs as --sglang-<flag>), plus the
launcher's own below. Engines run as Ray actors (EngineActor), the policy as a group of Ray
actors (TrainGroup of TrainActor ranks); on a machine without GPUs a local Ray with CPU bundles.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
import time
from typing import Any, NamedTuple, Optional, Sequence

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollout import config as rollout_config
from rollout.config import RolloutArgs
from rollout.debug_data import load_debug_rollout_data, save_debug_rollout_data
from rollout.metrics import MetricsLogger, rollout_metrics
from rollout.sample import Sample
from spec_engine.args import engine_args as engine_config
from spec_engine.args.engine_args import EngineArgs
from trainer_bridge.actor import TrainBatch, TrainerArgs
from spec_engine.args.dataclass_cli import add_dataclass_args, dataclass_from_args
from trainer_bridge.loss import LossConfig
from trainer_bridge.weight_sync import WeightSyncConfig

logger = logging.getLogger("specrl.train")

ENGINE_PREFIX = "sglang-"
# Engine flags the launcher sets itself, and the launcher flag that controls each.
LAUNCHER_OWNED = {
    "model_path": "--hf-checkpoint", "tokenizer_path": "--hf-checkpoint", "random_seed": "--seed",
    "host": "the launcher (engines are Ray actors, not servers)", "port": "the launcher (engines are Ray actors, not servers)",
    "api_key": "the launcher (engines are Ray actors, not servers)", "skip_server_warmup": "the launcher",
    "weight_version": "the launcher (it counts weight updates)", "skip_tokenizer_init": "the launcher (rewards need text)",
}
# SGLang flags specrl's engine does not have, and what does their job here.
SGLANG_ONLY = {"tp_size": "--rollout-num-gpus-per-engine", "enable_memory_saver": "--colocate",
               "dp_size": "--rollout-num-gpus (one engine per device)"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run = parser.add_argument_group("launcher")
    run.add_argument("--num-rollout", type=int, required=True, help="Rollouts (RL steps) to run.")
    run.add_argument("--output-dir", required=True, help="Where metrics.jsonl, checkpoints and logs go.")
    run.add_argument("--save", default=None, help="Save a Hugging Face checkpoint here every --save-interval rollouts ({rollout_id} is filled in).")
    run.add_argument("--save-interval", type=int, default=None, help="Rollouts between checkpoints (the last rollout is always saved when --save is given).")
    run.add_argument("--rollout-num-gpus", type=int, default=1, help="Devices (CPU bundles without GPUs) for all engines together.")
    run.add_argument("--rollout-num-gpus-per-engine", type=int, default=1, help="Devices per engine; engines = num-gpus / per-engine.")
    run.add_argument("--actor-num-nodes", type=int, default=1, help="Nodes of trainer ranks.")
    run.add_argument("--actor-num-gpus-per-node", type=int, default=1, help="Trainer ranks per node (one GPU each; CPUs without GPUs); TP groups come from --tensor-model-parallel-size, the rest is data parallel.")
    run.add_argument("--colocate", action="store_true", help="Engines release weights and KV while the trainer runs.")
    run.add_argument("--debug-rollout-only", action="store_true", help="Rollouts only: no trainer, no training, no weight update.")
    run.add_argument("--debug-train-only", action="store_true", help="Training only, on --load-debug-rollout-data: no engines.")
    run.add_argument("--use-wandb", action="store_true", help="Log to wandb (offline unless WANDB_MODE is set).")
    run.add_argument("--wandb-project", default=None, help="wandb project.")
    run.add_argument("--use-tensorboard", action="store_true", help="Log to tensorboard under --output-dir.")
    run.add_argument("--dry-run", action="store_true", help="Check the flags, print the resolved options and exit.")
    run.add_argument("--ray-num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all).")
    add_dataclass_args(parser, TrainerArgs, "trainer (trainer_bridge.actor.TrainerArgs)")
    add_dataclass_args(parser, LossConfig, "policy loss (trainer_bridge.loss.LossConfig)")
    add_dataclass_args(parser, WeightSyncConfig, "weight sync (trainer_bridge.weight_sync.WeightSyncConfig)")
    rollout_config.add_cli_args(parser)
    engine_config.add_cli_args(parser, prefix=ENGINE_PREFIX, exclude=LAUNCHER_OWNED)
    return parser


def check_engine_flags(argv: Sequence[str]) -> None:
    """Refuse launcher-owned and unknown --sglang-* flags with a message naming the right one."""
    known = set(engine_config.field_names()) - set(LAUNCHER_OWNED)
    for arg in argv:
        if not arg.startswith("--" + ENGINE_PREFIX) and not arg.startswith("--sglang_"):
            continue
        name = arg[2 + len(ENGINE_PREFIX):].split("=", 1)[0].replace("-", "_")
        if name in LAUNCHER_OWNED:
            raise SystemExit(f"error: {arg.split('=')[0]} is set by the launcher; use {LAUNCHER_OWNED[name]} instead")
        if name in SGLANG_ONLY:
            raise SystemExit(f"error: {arg.split('=')[0]} is not an engine flag in specrl; use {SGLANG_ONLY[name]}")
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.5)
            hint = f"; did you mean --{ENGINE_PREFIX}{close[0].replace('_', '-')}?" if close else ""
            raise SystemExit(f"error: unknown engine flag {arg.split('=')[0]}{hint}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    check_engine_flags(argv)
    args = build_parser().parse_args(argv)
    if args.load_debug_rollout_data is not None:
        args.debug_train_only = True  # as in slime: saved rollouts need no engines
    if args.debug_rollout_only and args.debug_train_only:
        raise SystemExit("error: --debug-rollout-only and --debug-train-only (or --load-debug-rollout-data) exclude each other")
    if args.hf_checkpoint is None:
        raise SystemExit("error: --hf-checkpoint is required")
    if args.rollout_num_gpus_per_engine != 1:
        raise SystemExit(f"error: --rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine}: engines run on one "
                         "device each for now; use 1 and raise --rollout-num-gpus for more engines")
    if args.save_interval is not None and args.save_interval <= 0:
        raise SystemExit(f"error: --save-interval must be positive, got {args.save_interval}")
    if args.debug_rollout_only and args.save:
        raise SystemExit("error: --save writes the trained policy, and --debug-rollout-only trains nothing")
    if args.bf16 and not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("error: --bf16 needs CUDA (megatron's mixed-precision optimizer); train in float32 on CPU")
    if args.debug_train_only and args.load_debug_rollout_data is None:
        raise SystemExit("error: --debug-train-only trains on saved rollouts: give --load-debug-rollout-data")
    if (args.eval_interval is None) != (args.eval_prompt_data is None):
        raise SystemExit("error: --eval-interval and --eval-prompt-data go together (how often, and on what)")
    try:  # every options class validates itself now, before any engine or trainer starts
        args.options = Options(
            dataclass_from_args(TrainerArgs, args), dataclass_from_args(LossConfig, args),
            dataclass_from_args(WeightSyncConfig, args), rollout_config.from_cli_args(args),
            engine_config.from_cli_args(args, prefix=ENGINE_PREFIX, model_path=args.hf_checkpoint,
                                        random_seed=args.seed, weight_version="0"))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return args


class Options(NamedTuple):
    """Each package's options, built (and validated) once from the flags."""

    trainer: TrainerArgs
    loss: LossConfig
    sync: WeightSyncConfig
    rollout: RolloutArgs
    engine: EngineArgs


def to_train_batch(groups: list[list[Sample]]) -> TrainBatch:
    """The trainer's batch; the group size (GRPO's n) is read from the groups themselves."""
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups of different sizes {sorted(sizes)}; group-relative advantages need equal groups")
    samples = [s for g in groups for s in g]
    return TrainBatch(tokens=[list(s.tokens) for s in samples], response_lengths=[s.response_length for s in samples],
                      rewards=[float(s.reward) for s in samples], loss_masks=[list(s.loss_mask) for s in samples],
                      rollout_log_probs=[list(s.rollout_log_probs) for s in samples],
                      n_samples_per_prompt=sizes.pop())


def start_engines(args: argparse.Namespace, engine_args: EngineArgs) -> list[Any]:
    """EngineActors in a placement group of one bundle per engine (GPUs, else CPUs)."""
    import ray

    from rollout.engine_actor import EngineActor
    from trainer_bridge.actor_group import reserve_bundles

    _, options = reserve_bundles(args.rollout_num_gpus // args.rollout_num_gpus_per_engine,
                                 args.rollout_num_gpus_per_engine, "--rollout-num-gpus")
    actors = [ray.remote(EngineActor).options(**o).remote(**engine_args.to_dict()) for o in options]
    ray.get([a.get_server_info.remote() for a in actors])  # wait until every engine is up
    return actors


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    opts = args.options
    if args.dry_run:
        for options in opts:
            print(options)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import ray
    from transformers import AutoTokenizer

    from rollout.engine_actor import RayEngineHandle
    from rollout.manager import RolloutManager
    from trainer_bridge.actor_group import TrainGroup

    ray.init(num_cpus=args.ray_num_cpus, include_dashboard=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    rollout_args, sync_cfg = opts.rollout, opts.sync
    tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    engines = [] if args.debug_train_only else start_engines(args, opts.engine)
    trainer = None if args.debug_rollout_only else TrainGroup(
        opts.trainer, opts.loss, rollout_args.rollout_temperature, args.actor_num_nodes * args.actor_num_gpus_per_node)
    manager = RolloutManager(rollout_args, [RayEngineHandle(e) for e in engines], tokenizer)
    progress = Progress(TextColumn("rollout {task.fields[rollout]}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("groups"), TimeElapsedColumn(), transient=True)
    manager.on_group_kept = lambda done, total: progress.update(bar, completed=done, total=total)
    metrics_log = MetricsLogger(args.output_dir, use_wandb=args.use_wandb, wandb_project=args.wandb_project,
                                config=vars(args), use_tensorboard=args.use_tensorboard)
    weight_version = 0  # the engines start at "0" (the --hf-checkpoint weights)
    try:
        progress.start()
        for rollout_id in range(args.num_rollout):
            step_start = time.perf_counter()
            if args.load_debug_rollout_data is not None:
                groups = load_debug_rollout_data(args.load_debug_rollout_data, rollout_id)
                metrics = {k: v for k, v in rollout_metrics(groups, 0.0).items() if not k.startswith("perf/")}
            else:
                bar = progress.add_task("", total=rollout_args.rollout_batch_size, rollout=rollout_id)
                groups, metrics = manager.generate(rollout_id)
                progress.remove_task(bar)
            if args.save_debug_rollout_data is not None:
                save_debug_rollout_data(args.save_debug_rollout_data, rollout_id, groups)
            metrics["rollout/weight_version"] = weight_version  # the weights that generated this rollout
            if trainer is not None:
                if args.colocate:
                    ray.get([e.release_memory_occupation.remote() for e in engines])
                metrics.update(trainer.train(to_train_batch(groups)))
                if args.colocate:
                    ray.get([e.resume_memory_occupation.remote() for e in engines])
                if engines:
                    weight_version += 1
                    update = trainer.push_weights(engines, sync_cfg, str(weight_version), args.output_dir)
                    metrics["perf/update_weights_time"] = update["seconds"]
                last = rollout_id == args.num_rollout - 1
                if args.save and (last or (args.save_interval and (rollout_id + 1) % args.save_interval == 0)):
                    trainer.save_hf(args.save.format(rollout_id=rollout_id))
            if engines and rollout_args.eval_interval and (rollout_id + 1) % rollout_args.eval_interval == 0:
                metrics.update(manager.eval(rollout_id)[1])
            metrics["perf/step_time"] = time.perf_counter() - step_start
            metrics_log.log(rollout_id, metrics)
            logger.info("rollout %d: %s", rollout_id, {k: round(v, 4) for k, v in metrics.items()})
    finally:
        progress.stop()
        metrics_log.close()
        if trainer is not None:
            trainer.shutdown()
        for engine in engines:
            try:
                ray.get(engine.shutdown.remote(), timeout=60)
            except Exception as e:  # a dead engine must not hide the run's own error or keep Ray up
                logger.warning("engine shutdown failed: %s", e)
        ray.shutdown()


if __name__ == "__main__":
    main()
