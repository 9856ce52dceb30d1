"""create_worker: the decoding worker for --speculative-algorithm."""

from __future__ import annotations

from spec_engine.args.resolve import EngineConfig
from spec_engine.core.worker import AllocFn, ModelWorker
from spec_engine.runner.model_runner import ModelRunner
from spec_engine.speculative.draft_runner import DraftRunner
from spec_engine.speculative.eagle_worker import EagleWorker
from spec_engine.speculative.ngram import NgramWorker


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
