"""create_worker and create_policy: the decoding worker for --speculative-algorithm, and the
policy the scheduler asks how to decode with it."""

from __future__ import annotations

from spec_engine.args.engine_args import EngineArgs
from spec_engine.args.resolve import EngineConfig
from spec_engine.core.policy import DecodePolicy
from spec_engine.core.worker import AllocFn, ModelWorker
from spec_engine.runner.model_runner import ModelRunner
from spec_engine.speculative.base import SpecWorker
from spec_engine.speculative.draft_runner import DraftRunner
from spec_engine.speculative.eagle_worker import EagleWorker
from spec_engine.speculative.ngram import NgramWorker
from spec_engine.speculative.policy import SpecPolicy


def create_worker(
    config: EngineConfig, runner: ModelRunner, alloc_kv: AllocFn, eos_token_ids: frozenset[int]
) -> ModelWorker:
    """The worker for `--speculative-algorithm` (plain decoding without one)."""
    args = config.args
    if args.speculative_algorithm is None:
        return ModelWorker(runner, alloc_kv, eos_token_ids)
    if config.draft_kind is None:  # NGRAM: no draft model
        return NgramWorker(runner, alloc_kv, eos_token_ids, args)
    return EagleWorker(runner, alloc_kv, eos_token_ids, args, DraftRunner(config, runner))


def create_policy(args: EngineArgs, worker: ModelWorker) -> DecodePolicy:
    """The speculation policy over a speculative `worker`; plain decoding's otherwise."""
    return SpecPolicy(args, worker) if isinstance(worker, SpecWorker) else DecodePolicy()
