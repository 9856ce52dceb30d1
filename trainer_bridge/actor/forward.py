"""The policy's forward passes on one trainer rank: a batch's rows planned into micro batches, each
laid out as --qkv-format asks, run through the policy (or the frozen reference model) with the
rollout's MoE routes replayed, and the sampled tokens' log-probs read off the logits.

Log-probs are log_softmax(logits / temperature) of the sampled token, as the engine reports them;
the logits are the real vocabulary's (megatron pads its vocabulary for tensor parallelism).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from spec_engine.models.hf_config import ModelConfig
from trainer_bridge import loss as losses
from trainer_bridge.batch import TrainBatch, pad_batch
from trainer_bridge.micro_batches.layout import MicroBatch
from trainer_bridge.micro_batches.plan import plan_micro_batches
from trainer_bridge.options import TrainerArgs
from trainer_bridge.parallel.data import DataParallel
from trainer_bridge.parallel.expert import aligned_micro_batch
from trainer_bridge.parallel.sequence import local_tokens
from trainer_bridge.routing_replay import replayed, routes_for


@contextlib.contextmanager
def without_mtp(model: Any) -> Iterator[None]:
    """Megatron's GPTModel runs its MTP block (and needs labels) inside forward; the policy's
    logits do not depend on it, and the MTP loss is computed separately (with a detached
    trunk: trainer_bridge.drafts.mtp_loss)."""
    saved = (model.mtp_process, model.config.mtp_num_layers)
    model.mtp_process, model.config.mtp_num_layers = False, None
    try:
        yield
    finally:
        model.mtp_process, model.config.mtp_num_layers = saved


class PolicyForward:
    """TrainActor's forward passes and log-probs. The attributes below are the rank's, set by
    TrainActor.__init__ (trainer_bridge.actor.train_actor)."""

    args: TrainerArgs
    arch: ModelConfig
    device: torch.device
    temperature: float
    gpt: Any  # the policy: megatron's GPTModel
    model: Any  # the policy in megatron's DistributedDataParallel
    ref: Any  # the frozen reference GPTModel of the KL term, or None
    dp: DataParallel

    def _micro_batch(self, tokens: Tensor, lengths: list[int]) -> MicroBatch:
        """Padded `tokens` [b, S] (row i holding lengths[i] tokens) in --qkv-format's layout,
        its sequence a multiple of the TP size (which sequence parallelism splits it by), as
        long as the expert group's (a collective over it at EP > 1)."""
        return aligned_micro_batch(tokens, lengths, self.args)

    def _micro_batches(
        self, rows: Sequence[int], lengths: list[int], log_probs: bool = False
    ) -> list[list[int]]:
        """`rows` of a batch (row i holding lengths[i] tokens) in micro batches, as many on every
        data-parallel rank (trainer_bridge.micro_batches.plan): --micro-batch-size rows each, or
        with --use-dynamic-batch-size as many as fit --max-tokens-per-gpu
        (--log-probs-max-tokens-per-gpu for `log_probs`)."""
        args = self.args
        budget = args.log_probs_max_tokens_per_gpu if log_probs else args.max_tokens_per_gpu
        return plan_micro_batches(
            rows,
            [lengths[i] for i in rows],
            args.micro_batch_size,
            budget if args.use_dynamic_batch_size else None,
            packed=args.qkv_format == "thd",
            align=self.dp.max,
        )

    def _forward(
        self, batch: MicroBatch, reference: bool = False, routes: Optional[Tensor] = None
    ) -> tuple[Tensor, Tensor]:
        """(logits over the real vocabulary [b, s, V], trunk hidden states [s, b, h]) of the
        policy, or of the frozen reference model, in `batch`'s layout (packed: b = 1, s = T);
        MoE layers route to `routes` [b, S, MoE layers, top_k] (padded layout) when given."""
        gpt, run = (self.ref, self.ref) if reference else (self.gpt, self.model)
        captured = []
        hook = gpt.decoder.register_forward_hook(lambda _m, _i, out: captured.append(out))
        try:
            routes = None if routes is None else local_tokens(gpt, batch.pack(routes))
            with without_mtp(gpt), replayed(gpt, routes):
                logits = run(
                    batch.tokens,
                    batch.position_ids,
                    None,
                    packed_seq_params=batch.packed_seq_params,
                    runtime_gather_output=True,
                    padding_mask=batch.padding_mask,
                )
        finally:
            hook.remove()
        return logits[..., : self.arch.vocab_size], captured[0]

    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, reference: bool = False) -> list[list[float]]:
        """Per response token: log_softmax(logits / temperature) of the sampled token (of the
        frozen reference model with `reference`)."""
        self.model.eval()
        out: list[list[float]] = [[] for _ in batch.tokens]
        lengths = [len(seq) for seq in batch.tokens]
        for rows in self._micro_batches(range(len(batch)), lengths, log_probs=True):
            part = batch.select(rows)
            tokens, _, _ = pad_batch(part, self.device)
            routes = routes_for(self.args, part, tokens.shape[1], self.arch, self.device)
            mb = self._micro_batch(tokens, [lengths[i] for i in rows])
            logits, _ = self._forward(mb, reference, routes)
            logp = mb.unpack(
                losses.token_log_probs(logits[:, :-1], mb.tokens[:, 1:], self.temperature), 1
            ).tolist()
            for row, values, n in zip(rows, logp, part.response_lengths):
                out[row] = values[lengths[row] - n - 1 : lengths[row] - 1]
        return out

    def _logp_matrix(self, batch: TrainBatch, width: int, reference: bool = False) -> Tensor:
        """compute_log_probs laid out like pad_batch's mask ([len(batch), width]; position t
        scores token t + 1; zero outside the responses)."""
        out = torch.zeros(len(batch), width, dtype=torch.float32, device="cpu")
        for i, (seq, n, lp) in enumerate(
            zip(batch.tokens, batch.response_lengths, self.compute_log_probs(batch, reference))
        ):
            out[i, len(seq) - n - 1 : len(seq) - 1] = torch.tensor(
                lp, dtype=torch.float32, device="cpu"
            )
        return out.to(self.device)
