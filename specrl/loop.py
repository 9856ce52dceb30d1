"""The RL loop: rollout -> samples -> train -> weight update -> next rollout (slime's train.py).

`train(args)` reads as the loop itself: `setup` starts the pieces, each rollout is one
`rollout_step` (`generate`, `train_step`, `update_weights`, `save`, `evaluate`), and `main`
parses the flags and prints the run's `summary`. `scripts/train.py` is its command.

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
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError
from transformers import AutoTokenizer

from rollout.debug_data import load_debug_rollout_data, save_debug_rollout_data
from rollout.engine_group import EngineGroup
from rollout.engine_load import BatchSizeTrace
from rollout.manager import Groups, RolloutManager
from rollout.metrics import MetricsLogger, rollout_metrics, staleness_metrics
from rollout.router import EngineDied
from spec_engine.models.hf_config import ModelConfig
from specrl import checkpoint as run_checkpoint
from specrl.checkpoint import Resume
from specrl.console import quiet_known_noise, setup_logging
from specrl.fault_tolerance import EngineRestarter, EngineRestartsExhausted, fatal_message
from specrl.health import HealthMonitor
from specrl.placement import Placements, create_placements, init_ray
from specrl.plots import BATCH_SIZE_SERIES, write_run_plots
from specrl.progress import RolloutProgress
from specrl.summary import rollout_line, summarize
from specrl.train_batch import to_train_batch
from specrl.train_options import check_checkpoints, parse_args
from trainer_bridge.actor.group import TrainerDied, TrainGroup

# An ExitStack exit callback: (exc_type, exc, traceback) -> whether it swallows the error.
ExitHook = Callable[[type[BaseException] | None, BaseException | None, object], bool]
# The name a run's log lines carry (stderr shows it): the loop's, since scripts/train.py held it.
logger = logging.getLogger("specrl.train")

Metrics = dict[str, float]
# The key of a checkpoint's rollout generated but not trained yet (scripts/train_async.py's).
PENDING_ROLLOUT = "pending_rollout"


@dataclass
class Run:
    """What `setup` started, and the state the loop carries from one rollout to the next."""

    args: argparse.Namespace
    engines: EngineGroup  # none with --debug-train-only
    trainer: TrainGroup | None  # none with --debug-rollout-only
    manager: RolloutManager
    progress: RolloutProgress
    weight_version: int = 0  # of the weights the engines hold
    policy_version: int = 0  # of the policy's weights: the rollouts it has trained on
    start_rollout_id: int = 0
    wandb_run_id: str = ""
    restarter: EngineRestarter | None = None  # --use-fault-tolerance
    # Health checks (--use-fault-tolerance) run only inside it: while rollouts run, not while a
    # push may hold an engine.
    checked: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def train(args: argparse.Namespace, resume: Resume | None = None) -> str:
    """Runs --num-rollout rollouts (each trained on, unless --debug-rollout-only), from `resume`
    when given; returns the path of the run's metrics.jsonl. Each started piece registers its
    shutdown on `teardown`, which runs all of them (newest first) however the run ends, even
    when one of them fails."""
    with contextlib.ExitStack() as teardown:
        start = time.perf_counter()
        run = setup(args, resume, teardown)
        metrics_log = open_metrics_log(run, resume, teardown)
        log_start(run, start)
        for rollout_id in range(run.start_rollout_id, args.num_rollout):
            metrics = rollout_step(run, rollout_id)
            log_rollout(run, metrics_log, rollout_id, metrics, run.manager.batch_size_trace)
        return metrics_log.path


def log_start(run: Run, start: float) -> None:
    """The line that says the run is ready, and what it will run."""
    rollout = run.args.options.rollout
    logger.info(
        "ready in %.0f s; %d rollouts of %d prompts x %d samples",
        time.perf_counter() - start,
        run.args.num_rollout,
        rollout.rollout_batch_size,
        rollout.n_samples_per_prompt,
    )


def log_rollout(
    run: Run, metrics_log: MetricsLogger, rollout_id: int, metrics: Metrics, trace: BatchSizeTrace
) -> None:
    """A rollout's metrics line (and the engines' batch sizes it polled) and its stdout line."""
    metrics_log.log(rollout_id, metrics)
    if trace.times:  # plotted by specrl.plots
        metrics_log.log_series(rollout_id, BATCH_SIZE_SERIES, trace.to_dict())
    logger.info(rollout_line(rollout_id, run.args.num_rollout, metrics))


def setup(args: argparse.Namespace, resume: Resume | None, teardown: contextlib.ExitStack) -> Run:
    """Ray, the engines and the trainer, the rollout manager, the resumed state, the engines on
    the policy's weights, and fault tolerance: everything the loop runs on."""
    logger.info("starting Ray")
    init_ray(args.ray_num_cpus)
    teardown.push(shutdown_step("ray.shutdown", ray.shutdown))
    engines, trainer = start_actors(args, create_placements(args), teardown)
    tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    manager = RolloutManager(args.options.rollout, engines.handles, tokenizer, launcher_args=args)
    progress = RolloutProgress()
    manager.on_group_kept = progress.update
    # The engines start at version 0 (the --hf-checkpoint weights, or --ref-load's once pushed).
    run = Run(
        args, engines, trainer, manager, progress, wandb_run_id=run_checkpoint.new_wandb_run_id()
    )
    if resume is not None:
        resume_from(run, resume)
    # The engines generate from the policy: a resumed one, or --ref-load's (slime's start)
    starts_elsewhere = resume is not None or args.options.trainer.ref_load is not None
    if starts_elsewhere and trainer is not None and engines.actors:
        push_weights(run, engines.actors)
    if args.start_rollout_id is not None:
        run.start_rollout_id = args.start_rollout_id
    if args.use_fault_tolerance and engines.actors:
        watch_engines(run, teardown)
    return run


def start_actors(
    args: argparse.Namespace, placements: Placements, teardown: contextlib.ExitStack
) -> tuple[EngineGroup, TrainGroup | None]:
    """The engines, up, and the policy's ranks, loaded."""
    logger.info(
        "starting %d engine(s) and %d trainer rank(s)",
        len(placements.engines),
        len(placements.trainer),
    )
    # With --colocate the engines size their KV cache from the device memory the trainer
    # leaves, so the trainer loads first; otherwise both load side by side.
    trainer = start_trainer(args, placements, teardown) if args.colocate else None
    engines = EngineGroup(args.options.engine, placements.engines)
    teardown.push(shutdown_step("stopping the engines", engines.shutdown))
    if not args.colocate:
        trainer = start_trainer(args, placements, teardown)
    engines.wait_until_up()
    return engines, trainer


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
    teardown.push(shutdown_step("stopping the trainer", trainer.shutdown))
    return trainer


def resume_from(run: Run, resume: Resume) -> None:
    """The policy, the prompt position and the counters of a --load checkpoint: the run goes on
    with the rollout after it."""
    logger.info("resuming from %s", resume.directory)
    if run.trainer is not None:
        run.trainer.load_checkpoint(resume.directory)
    run.manager.load_state_dict(resume.state["rollout"])
    run.weight_version = run.policy_version = resume.state["weight_version"]
    run.wandb_run_id = resume.state["wandb_run_id"]
    run.start_rollout_id = resume.rollout_id + 1


def watch_engines(run: Run, teardown: contextlib.ExitStack) -> None:
    """--use-fault-tolerance: the rollout router replaces a dead engine by a fresh one holding
    the policy's current weights, and health checks find a hung one while rollouts run."""
    args = run.args
    push = None
    if run.trainer is not None:

        def push(actor: object) -> None:
            push_weights(run, [actor])

    run.restarter = EngineRestarter(run.engines, args.max_engine_restarts, push)
    run.manager.router.restart_engine = run.restarter
    monitor = HealthMonitor(
        run.engines,
        args.rollout_health_check_interval,
        args.rollout_health_check_timeout,
        args.rollout_health_check_first_wait,
    )
    teardown.push(shutdown_step("stopping the health checks", monitor.stop))
    run.checked = monitor.active


def open_metrics_log(
    run: Run, resume: Resume | None, teardown: contextlib.ExitStack
) -> MetricsLogger:
    """metrics.jsonl under --output-dir (and wandb, tensorboard), continuing a resumed run's."""
    args = run.args
    metrics_log = MetricsLogger(
        args.output_dir,
        use_wandb=args.use_wandb,
        config=vars(args),
        wandb_project=args.wandb_project,
        use_tensorboard=args.use_tensorboard,
        wandb_run_id=run.wandb_run_id,
        resume_step=run.start_rollout_id if resume is not None else None,
    )
    teardown.push(shutdown_step("closing the metrics log", metrics_log.close))
    return metrics_log


def rollout_step(run: Run, rollout_id: int) -> Metrics:
    """One rollout: generate (or load) it, train on it, push the new weights, save, evaluate;
    returns its metrics."""
    args = run.args
    start = time.perf_counter()
    faults_before = fault_counts(run)
    groups, metrics = generate(run, rollout_id)
    metrics.update(version_metrics(run, groups, run.weight_version))
    if run.trainer is not None:
        metrics.update(train_step(run, groups))
        if run.engines.actors:
            metrics["perf/update_weights_time"] = update_weights(run)
        if is_due(args.save_interval, rollout_id, args.num_rollout):
            save(run, rollout_id)
    if run.engines.actors and is_due(args.options.rollout.eval_interval, rollout_id):
        metrics.update(evaluate(run, rollout_id))
    metrics.update(fault_metrics(run, faults_before))
    metrics["perf/step_time"] = time.perf_counter() - start
    return metrics


def version_metrics(run: Run, groups: Groups, generated_by: int) -> Metrics:
    """The weight version that generated a rollout, and how stale its trained tokens are for
    the policy about to train on them."""
    metrics = {"rollout/weight_version": generated_by}
    if run.args.load_debug_rollout_data is None:  # a loaded rollout's versions are another run's
        metrics.update(staleness_metrics(groups, run.policy_version))
    return metrics


def fault_metrics(run: Run, before: tuple[int, int]) -> Metrics:
    """The engine restarts and redone requests since `before` (none without
    --use-fault-tolerance)."""
    if run.restarter is None:
        return {}
    restarts, redone = fault_counts(run)
    return {
        "rollout/engine_restarts": restarts - before[0],
        "rollout/requests_redone": redone - before[1],
    }


def generate(run: Run, rollout_id: int) -> tuple[Groups, Metrics]:
    """Rollout `rollout_id` from the engines, or from --load-debug-rollout-data; saved when
    --save-debug-rollout-data asks."""
    args = run.args
    if args.load_debug_rollout_data is not None:
        groups, metrics = load_rollout(args.load_debug_rollout_data, rollout_id)
    else:
        batch_size = args.options.rollout.rollout_batch_size
        with run.progress.rollout(rollout_id, batch_size), run.checked():
            groups, metrics = run.manager.generate(rollout_id)
    if args.save_debug_rollout_data is not None:
        save_debug_rollout_data(args.save_debug_rollout_data, rollout_id, groups)
    return groups, metrics


def train_step(run: Run, groups: Groups) -> Metrics:
    """The policy trained on one rollout; with --colocate the engines free the device meanwhile."""
    if run.args.colocate:
        run.engines.release_memory()
    metrics = run.trainer.train(to_train_batch(groups))
    run.policy_version += 1
    if run.args.colocate:
        run.engines.resume_memory()
    return metrics


def update_weights(run: Run) -> float:
    """The trained policy pushed to every engine, labelled with its version; the push's
    seconds."""
    run.weight_version = run.policy_version
    return push_weights(run, run.engines.actors)["seconds"]


def push_weights(run: Run, actors: Sequence[object]) -> dict[str, float]:
    """The policy's weights to `actors`, labelled with the run's current weight version."""
    args = run.args
    return run.trainer.push_weights(
        actors, args.options.sync, str(run.weight_version), args.output_dir, args.colocate
    )


def evaluate(run: Run, rollout_id: int) -> Metrics:
    """The --eval-prompt-data sets, generated by the current policy."""
    with run.checked():
        return run.manager.eval(rollout_id)[1]


def fault_counts(run: Run) -> tuple[int, int]:
    """(engines restarted, requests sent again) so far; zeros without --use-fault-tolerance."""
    if run.restarter is None:
        return 0, 0
    return run.restarter.used, run.manager.router.requests_redone


def save(run: Run, rollout_id: int, extra_state: dict | None = None) -> None:
    """The --save checkpoint (policy, then the launcher's state with `extra_state`, then the
    latest file) and the --save-hf export of rollout `rollout_id`."""
    args, trainer = run.args, run.trainer
    if args.save:
        state = run_checkpoint.new_run_state(
            run.policy_version, run.manager.state_dict(), run.wandb_run_id
        )
        state.update(extra_state or {})
        start = time.perf_counter()
        directory = run_checkpoint.save(
            args.save, rollout_id, lambda d: trainer.save_checkpoint(d, rollout_id), state
        )
        logger.info("saved %s in %.1f s", directory, time.perf_counter() - start)
    if args.save_hf:
        trainer.save_hf(args.save_hf.format(rollout_id=rollout_id))


def shutdown_step(what: str, step: Callable[[], object]) -> ExitHook:
    """One shutdown step for the run's ExitStack: the other steps still run when it fails, which
    is logged; its error is raised only when the run had none, so a failure on the way out never
    hides the error that ended the run (a dead actor's message names the checkpoint to resume
    from)."""

    def exit_hook(exc_type: type[BaseException] | None, *_: object) -> bool:
        try:
            step()
        except Exception:
            logger.exception("%s failed", what)
            if exc_type is None:
                raise
        return False  # never swallows the run's own error

    return exit_hook


def load_rollout(path: str, rollout_id: int) -> tuple[Groups, Metrics]:
    """A rollout saved by --save-debug-rollout-data, and its metrics (no perf/*: nothing ran)."""
    groups = load_debug_rollout_data(path, rollout_id)
    metrics = rollout_metrics(groups, 0.0)
    return groups, {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def is_due(interval: int | None, rollout_id: int, num_rollout: int | None = None) -> bool:
    """Every `interval` rollouts; also after the last one when `num_rollout` is given."""
    last = num_rollout is not None and rollout_id == num_rollout - 1
    return last or (interval is not None and (rollout_id + 1) % interval == 0)


def main(argv: Sequence[str] | None = None) -> None:
    """scripts/train.py: the flags checked before anything starts (--dry-run prints them and
    stops), the run, and its summary; a dead actor ends it with a message and a non-zero exit."""
    args = parse_args(argv)
    if args.update_weights_interval != 1:
        raise SystemExit(
            f"error: --update-weights-interval {args.update_weights_interval}: scripts/train.py "
            "pushes the weights after every step (as slime's train.py); the interval is for "
            "scripts/train_async.py"
        )
    resume, resolved = resolve_run(args)
    if resume is not None and resume.state.get(PENDING_ROLLOUT):
        raise SystemExit(
            f"error: --load {resume.directory} was saved by scripts/train_async.py with rollout "
            f"{resume.rollout_id + 1} already generated; resume it with scripts/train_async.py "
            "(scripts/train.py would skip that rollout's prompts)"
        )
    run_command(args, resume, resolved, train)


def resolve_run(args: argparse.Namespace) -> tuple[Resume | None, list[str]]:
    """The checkpoint to resume from, and the lines --dry-run prints about what was resolved."""
    resolved = check_checkpoints(args) + args.compat_notes
    setup_logging()
    resume = run_checkpoint.resolve(args, ModelConfig.load(args.hf_checkpoint).hf_config)
    if resume is not None:
        resolved.append(f"resume: {resume.directory} (rollout {resume.rollout_id})")
    return resume, resolved


def run_command(
    args: argparse.Namespace,
    resume: Resume | None,
    resolved: list[str],
    driver: Callable[[argparse.Namespace, Resume | None], str],
) -> None:
    """--dry-run's printout, or the run (`driver`: train, or the async loop's) and its summary;
    a dead actor ends it with a message and a non-zero exit."""
    if args.dry_run:
        for options in args.options:
            print(options)
        print("\n".join(resolved))
        return
    quiet_known_noise()
    try:
        metrics_path = driver(args, resume)
    except (EngineDied, EngineRestartsExhausted, TrainerDied, RayActorError) as e:
        # An actor is gone (Ray has logged its story): say which, and where to resume from.
        logger.debug("the run ended on a dead actor", exc_info=True)
        raise SystemExit(fatal_message(e, args)) from None
    print(summary(metrics_path, args.output_dir))


def summary(metrics_path: str, output_dir: str) -> str:
    """The run's plots under output_dir/plots, and the closing summary that names them."""
    plots = write_run_plots(metrics_path, os.path.join(output_dir, "plots"))
    return summarize(metrics_path, plots)
