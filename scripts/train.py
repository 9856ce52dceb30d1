"""The RL loop: rollout -> samples -> train -> weight update -> next rollout (slime's train.py).

    python -m scripts.train --hf-checkpoint M --prompt-data D.jsonl --rollout-batch-size 8 \\
        --n-samples-per-prompt 4 --rm-type tiny --num-rollout 10 --output-dir runs/x \\
        --sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 2

The pieces: flags (specrl.train_options), Ray and its bundles (specrl.placement), the engines
(rollout.engine_group), the policy (trainer_bridge.actor_group), rollouts (rollout.manager), and
what a run prints (specrl.console, specrl.summary, specrl.plots).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Sequence

import ray
from transformers import AutoTokenizer

from rollout.debug_data import load_debug_rollout_data, save_debug_rollout_data
from rollout.engine_group import EngineGroup
from rollout.manager import Groups, RolloutManager
from rollout.metrics import MetricsLogger, rollout_metrics
from specrl.console import quiet_known_noise, setup_logging
from specrl.placement import Placements, create_placements, init_ray
from specrl.plots import write_run_plots
from specrl.progress import RolloutProgress
from specrl.summary import rollout_line, summarize
from specrl.train_batch import to_train_batch
from specrl.train_options import check_checkpoints, parse_args
from trainer_bridge.actor_group import TrainGroup

logger = logging.getLogger("specrl.train")


def train(args: argparse.Namespace) -> str:
    """Runs --num-rollout rollouts (each trained on, unless --debug-rollout-only); returns the path
    of the run's metrics.jsonl."""
    opts = args.options
    start = time.perf_counter()
    logger.info("starting Ray")
    init_ray(args.ray_num_cpus)
    placements = create_placements(args)
    logger.info(
        "starting %d engine(s) and %d trainer rank(s)",
        len(placements.engines),
        len(placements.trainer),
    )
    # With --colocate the engines size their KV cache from the device memory the trainer
    # leaves, so the trainer loads first; otherwise both load side by side.
    trainer = start_trainer(args, placements) if args.colocate else None
    engines = EngineGroup(opts.engine, placements.engines)  # none with --debug-train-only
    if not args.colocate:
        trainer = start_trainer(args, placements)
    engines.wait_until_up()
    tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    manager = RolloutManager(opts.rollout, engines.handles, tokenizer, launcher_args=args)
    progress = RolloutProgress()
    manager.on_group_kept = progress.update
    metrics_log = MetricsLogger(
        args.output_dir,
        use_wandb=args.use_wandb,
        config=vars(args),
        wandb_project=args.wandb_project,
        use_tensorboard=args.use_tensorboard,
    )
    logger.info(
        "ready in %.0f s; %d rollouts of %d prompts x %d samples",
        time.perf_counter() - start,
        args.num_rollout,
        opts.rollout.rollout_batch_size,
        opts.rollout.n_samples_per_prompt,
    )
    weight_version = 0  # the engines start at "0" (the --hf-checkpoint weights)
    try:
        for rollout_id in range(args.num_rollout):
            step_start = time.perf_counter()
            if args.load_debug_rollout_data is not None:
                groups, metrics = load_rollout(args.load_debug_rollout_data, rollout_id)
            else:
                with progress.rollout(rollout_id, opts.rollout.rollout_batch_size):
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
                if args.save and is_due(args.save_interval, rollout_id, args.num_rollout):
                    trainer.save_hf(args.save.format(rollout_id=rollout_id))

            if engines.actors and is_due(opts.rollout.eval_interval, rollout_id):
                metrics.update(manager.eval(rollout_id)[1])
            metrics["perf/step_time"] = time.perf_counter() - step_start
            metrics_log.log(rollout_id, metrics)
            logger.info(rollout_line(rollout_id, args.num_rollout, metrics))
    finally:
        metrics_log.close()
        if trainer is not None:
            trainer.shutdown()
        engines.shutdown()
        ray.shutdown()
    return metrics_log.path


def start_trainer(args: argparse.Namespace, placements: Placements) -> TrainGroup | None:
    """The policy's ranks, loaded (none with --debug-rollout-only)."""
    if not placements.trainer:
        return None
    opts = args.options
    return TrainGroup(opts.trainer, opts.loss, opts.rollout.rollout_temperature, placements.trainer)


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
    resolved = check_checkpoints(args)
    if args.dry_run:
        for options in args.options:
            print(options)
        print("\n".join(resolved))
        return
    setup_logging()
    quiet_known_noise()
    metrics_path = train(args)
    plots = write_run_plots(metrics_path, os.path.join(args.output_dir, "plots"))
    print(summarize(metrics_path, plots))


if __name__ == "__main__":
    main()
