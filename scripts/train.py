"""The RL loop: rollout -> samples -> train -> weight update -> next rollout (slime's train.py).

    python -m scripts.train --hf-checkpoint M --prompt-data D.jsonl --rollout-batch-size 8 \\
        --n-samples-per-prompt 4 --rm-type tiny --num-rollout 10 --output-dir runs/x \\
        --sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 2

The pieces: flags (specrl.train_options), Ray and its bundles (specrl.placement), the engines
(rollout.engine_group), the policy (trainer_bridge.actor.group), rollouts (rollout.manager), and
what a run prints (specrl.console, specrl.summary, specrl.plots).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence

import ray
from ray.exceptions import RayActorError
from transformers import AutoTokenizer

from rollout.debug_data import load_debug_rollout_data, save_debug_rollout_data
from rollout.engine_group import EngineGroup
from rollout.manager import Groups, RolloutManager
from rollout.metrics import MetricsLogger, rollout_metrics
from rollout.router import EngineDied
from spec_engine.models.hf_config import ModelConfig
from specrl import checkpoint as run_checkpoint
from specrl.checkpoint import Resume
from specrl.console import quiet_known_noise, setup_logging
from specrl.fault_tolerance import EngineRestarter, EngineRestartsExhausted, fatal_message
from specrl.health import HealthMonitor
from specrl.placement import Placements, create_placements, init_ray
from specrl.plots import write_run_plots
from specrl.progress import RolloutProgress
from specrl.summary import rollout_line, summarize
from specrl.train_batch import to_train_batch
from specrl.train_options import check_checkpoints, parse_args
from trainer_bridge.actor.group import TrainerDied, TrainGroup

logger = logging.getLogger("specrl.train")


def train(args: argparse.Namespace, resume: Resume | None = None) -> str:
    """Runs --num-rollout rollouts (each trained on, unless --debug-rollout-only), from `resume`
    when given; returns the path of the run's metrics.jsonl."""
    with contextlib.ExitStack() as teardown:
        return _run(args, resume, teardown)


def _run(args: argparse.Namespace, resume: Resume | None, teardown: contextlib.ExitStack) -> str:
    """train()'s body; each started piece registers its shutdown on `teardown`, which runs all
    of them (newest first) however the run ends, even when one of them fails."""
    opts = args.options
    start = time.perf_counter()
    logger.info("starting Ray")
    init_ray(args.ray_num_cpus)
    teardown.callback(_logged, "ray.shutdown", ray.shutdown)
    placements = create_placements(args)
    logger.info(
        "starting %d engine(s) and %d trainer rank(s)",
        len(placements.engines),
        len(placements.trainer),
    )
    # With --colocate the engines size their KV cache from the device memory the trainer
    # leaves, so the trainer loads first; otherwise both load side by side.
    trainer = start_trainer(args, placements, teardown) if args.colocate else None
    engines = EngineGroup(opts.engine, placements.engines)  # none with --debug-train-only
    teardown.callback(_logged, "stopping the engines", engines.shutdown)
    if not args.colocate:
        trainer = start_trainer(args, placements, teardown)
    if trainer is not None and args.save:
        trainer.warm_checkpoint_writer()
    engines.wait_until_up()
    tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    manager = RolloutManager(opts.rollout, engines.handles, tokenizer, launcher_args=args)
    progress = RolloutProgress()
    manager.on_group_kept = progress.update
    # The engines start at version 0 (the --hf-checkpoint weights, or --ref-load's once pushed); a
    # resumed run continues the checkpoint's count.
    weight_version, start_rollout_id, wandb_run_id = 0, 0, run_checkpoint.new_wandb_run_id()
    if resume is not None:
        logger.info("resuming from %s", resume.directory)
        if trainer is not None:
            trainer.load_checkpoint(resume.directory)
        manager.load_state_dict(resume.state["rollout"])
        weight_version = resume.state["weight_version"]
        wandb_run_id = resume.state["wandb_run_id"]
        start_rollout_id = resume.rollout_id + 1
    # The engines generate from the policy: a resumed one, or --ref-load's (slime's start)
    starts_elsewhere = resume is not None or opts.trainer.ref_load is not None
    if starts_elsewhere and trainer is not None and engines.actors:
        trainer.push_weights(
            engines.actors, opts.sync, str(weight_version), args.output_dir, args.colocate
        )
    if args.start_rollout_id is not None:
        start_rollout_id = args.start_rollout_id
    restarter, checked = None, contextlib.nullcontext
    if args.use_fault_tolerance and engines.actors:
        restarter = install_restarter(args, engines, trainer, manager, lambda: weight_version)
        monitor = HealthMonitor(
            engines,
            args.rollout_health_check_interval,
            args.rollout_health_check_timeout,
            args.rollout_health_check_first_wait,
        )
        teardown.callback(_logged, "stopping the health checks", monitor.stop)
        checked = monitor.active  # only while rollouts run: pushes may hold an engine
    metrics_log = MetricsLogger(
        args.output_dir,
        use_wandb=args.use_wandb,
        config=vars(args),
        wandb_project=args.wandb_project,
        use_tensorboard=args.use_tensorboard,
        wandb_run_id=wandb_run_id,
        resume_step=start_rollout_id if resume is not None else None,
    )
    teardown.callback(_logged, "closing the metrics log", metrics_log.close)
    logger.info(
        "ready in %.0f s; %d rollouts of %d prompts x %d samples",
        time.perf_counter() - start,
        args.num_rollout,
        opts.rollout.rollout_batch_size,
        opts.rollout.n_samples_per_prompt,
    )
    for rollout_id in range(start_rollout_id, args.num_rollout):
        step_start = time.perf_counter()
        restarts_before = restarter.used if restarter is not None else 0
        redone_before = manager.router.requests_redone if restarter is not None else 0
        if args.load_debug_rollout_data is not None:
            groups, metrics = load_rollout(args.load_debug_rollout_data, rollout_id)
        else:
            with progress.rollout(rollout_id, opts.rollout.rollout_batch_size), checked():
                groups, metrics = manager.generate(rollout_id)
        if args.save_debug_rollout_data is not None:
            save_debug_rollout_data(args.save_debug_rollout_data, rollout_id, groups)
        metrics["rollout/weight_version"] = weight_version  # the weights that generated it

        if trainer is not None:
            if args.colocate:
                engines.release_memory()
            metrics.update(trainer.train(to_train_batch(groups)))
            if args.colocate:
                engines.resume_memory()
            if engines.actors:
                weight_version += 1
                update = trainer.push_weights(
                    engines.actors,
                    opts.sync,
                    str(weight_version),
                    args.output_dir,
                    colocated=args.colocate,
                )
                metrics["perf/update_weights_time"] = update["seconds"]
            if is_due(args.save_interval, rollout_id, args.num_rollout):
                save(args, trainer, rollout_id, weight_version, manager, wandb_run_id)

        if engines.actors and is_due(opts.rollout.eval_interval, rollout_id):
            with checked():
                metrics.update(manager.eval(rollout_id)[1])
        if restarter is not None:  # this rollout's (and its evaluation's) restarts
            metrics["rollout/engine_restarts"] = restarter.used - restarts_before
            metrics["rollout/requests_redone"] = manager.router.requests_redone - redone_before
        metrics["perf/step_time"] = time.perf_counter() - step_start
        metrics_log.log(rollout_id, metrics)
        logger.info(rollout_line(rollout_id, args.num_rollout, metrics))
    return metrics_log.path


def install_restarter(
    args: argparse.Namespace,
    engines: EngineGroup,
    trainer: TrainGroup | None,
    manager: RolloutManager,
    weight_version: Callable[[], int],
) -> EngineRestarter:
    """--use-fault-tolerance: the rollout router replaces a dead engine by a fresh one holding
    the policy's current weights (`weight_version()` when it restarts)."""
    push = None
    if trainer is not None:

        def push(actor: object) -> None:
            trainer.push_weights(
                [actor], args.options.sync, str(weight_version()), args.output_dir, args.colocate
            )

    restarter = EngineRestarter(engines, args.max_engine_restarts, push)
    manager.router.restart_engine = restarter
    return restarter


def save(
    args: argparse.Namespace,
    trainer: TrainGroup,
    rollout_id: int,
    weight_version: int,
    manager: RolloutManager,
    wandb_run_id: str,
) -> None:
    """The --save checkpoint (policy, then the launcher's state, then the latest file) and the
    --save-hf export of rollout `rollout_id`."""
    if args.save:
        state = run_checkpoint.new_run_state(weight_version, manager.state_dict(), wandb_run_id)
        start = time.perf_counter()
        directory = run_checkpoint.save(
            args.save, rollout_id, lambda d: trainer.save_checkpoint(d, rollout_id), state
        )
        logger.info("saved %s in %.1f s", directory, time.perf_counter() - start)
    if args.save_hf:
        trainer.save_hf(args.save_hf.format(rollout_id=rollout_id))


def start_trainer(
    args: argparse.Namespace, placements: Placements, teardown: contextlib.ExitStack
) -> TrainGroup | None:
    """The policy's ranks, loaded (none with --debug-rollout-only)."""
    if not placements.trainer:
        return None
    opts = args.options
    trainer = TrainGroup(
        opts.trainer, opts.loss, opts.rollout.rollout_temperature, placements.trainer
    )
    teardown.callback(_logged, "stopping the trainer", trainer.shutdown)
    return trainer


def _logged(what: str, step: Callable[[], object]) -> None:
    """One shutdown step; a failure is logged and re-raised (the other steps still run)."""
    try:
        step()
    except Exception:
        logger.exception("%s failed", what)
        raise


def load_rollout(path: str, rollout_id: int) -> tuple[Groups, dict[str, float]]:
    """A rollout saved by --save-debug-rollout-data, and its metrics (no perf/*: nothing ran)."""
    groups = load_debug_rollout_data(path, rollout_id)
    metrics = rollout_metrics(groups, 0.0)
    return groups, {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def is_due(interval: int | None, rollout_id: int, num_rollout: int | None = None) -> bool:
    """Every `interval` rollouts; also after the last one when `num_rollout` is given."""
    last = num_rollout is not None and rollout_id == num_rollout - 1
    return last or (interval is not None and (rollout_id + 1) % interval == 0)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    resolved = check_checkpoints(args) + args.compat_notes
    setup_logging()
    resume = run_checkpoint.resolve(args, ModelConfig.load(args.hf_checkpoint).hf_config)
    if resume is not None:
        resolved.append(f"resume: {resume.directory} (rollout {resume.rollout_id})")
    if args.dry_run:
        for options in args.options:
            print(options)
        print("\n".join(resolved))
        return
    quiet_known_noise()
    try:
        metrics_path = train(args, resume)
    except (EngineDied, EngineRestartsExhausted, TrainerDied, RayActorError) as e:
        # An actor is gone (Ray has logged its story): say which, and where to resume from.
        logger.debug("the run ended on a dead actor", exc_info=True)
        raise SystemExit(fatal_message(e, args)) from None
    plots = write_run_plots(metrics_path, os.path.join(args.output_dir, "plots"))
    print(summarize(metrics_path, plots))


if __name__ == "__main__":
    main()
