"""Speculative decoding: one worker per algorithm behind ModelWorker's interface.

EAGLE / EAGLE3 / STANDALONE and MTP (EAGLE with no draft path on a target with MTP layers) draft
with a model (eagle_worker.py); NGRAM drafts from an n-gram cache (ngram.py). All verify with
the same tree rejection sampling (verify.py) and KV bookkeeping (base.py).
"""

from __future__ import annotations

from spec_engine.args.engine_args import EngineArgs
from spec_engine.models.hf_config import ModelConfig
from spec_engine.runner.model_runner import ModelRunner
from spec_engine.core.worker import AllocFn, ModelWorker


def create_worker(args: EngineArgs, runner: ModelRunner, alloc_kv: AllocFn, eos_token_ids: frozenset[int]) -> ModelWorker:
    algo = args.speculative_algorithm
    if algo is None:
        return ModelWorker(runner, alloc_kv, eos_token_ids)
    if algo == "NGRAM":
        from spec_engine.speculative.ngram import NgramWorker

        return NgramWorker(runner, alloc_kv, eos_token_ids, args)
    from spec_engine.speculative.draft_runner import DraftRunner, draft_kind
    from spec_engine.speculative.eagle_worker import EagleWorker

    kind = draft_kind(algo, args.speculative_draft_model_path)
    if kind == "MTP":
        config, checkpoint = runner.model_config, args.model_path
    else:
        checkpoint = args.speculative_draft_model_path
        config = ModelConfig.from_pretrained(checkpoint)
    draft = DraftRunner(kind, config, checkpoint, runner, args.speculative_token_map)
    return EagleWorker(runner, alloc_kv, eos_token_ids, args, draft)
