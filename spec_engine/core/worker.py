"""The decoding worker interface, and ModelWorker: plain (non-speculative) decoding.

The scheduler decides which requests run and keeps KV headroom; a worker turns requests into
forward batches, allocates the KV slots its forwards write, and returns the tokens each
request emitted. The interface the scheduler sees is five methods: `prefill`, `decode`, the KV a
decode will allocate (`decode_kv_demand`) and may hold beyond a sequence (`decode_headroom`),
and `release`. Speculative workers (speculative/base.py) implement the same methods, may emit
several tokens per request per decode step, and decode at the depth the speculation policy
chose (0: plainly); what only speculation needs of them the policy asks them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from spec_engine.constrained.mask import mask_rows
from spec_engine.core.custom_logit_processor import apply_processors
from spec_engine.core.logits_processor import (
    NONFINITE_LOGITS,
    nonfinite_flags,
    process_logits,
    replace_nan,
    top_p_replay,
    wants_top_p_replay,
    warn_nan,
)
from spec_engine.core.readback import read_back
from spec_engine.core.request import Req
from spec_engine.forward_batch import ForwardBatch, ForwardMode
from spec_engine.layers.sampler import (
    DrawnTokens,
    SampleOutput,
    Sampler,
    SamplingBatch,
    request_uniform,
)
from spec_engine.mem.allocator import Slots
from spec_engine.mem.upload import upload
from spec_engine.runner.model_runner import ForwardOutput, ModelRunner

# alloc_kv(start_lens, end_lens, last_slots) -> slots; evicts cached prefixes when needed.
AllocFn = Callable[[Sequence[int], Sequence[int], Sequence[int]], Slots]


@dataclass
class StepResult:
    """Per request, the tokens emitted this step (empty for an unfinished prefill chunk)."""

    tokens: list[list[int]]
    logprobs: Optional[list[list[float]]] = None
    top_logprobs: Optional[list[list[list[tuple[float, int]]]]] = None
    # Per request and emitted token, the log-probs of its token_ids_logprob.
    token_ids_logprobs: Optional[list[list[list[float]]]] = None
    # Speculative decode steps: draft tokens proposed per request (None for plain steps).
    drafted: Optional[list[int]] = None
    # Speculative decode steps: the tree nodes each request accepted, root first (the adaptive
    # cost model reads what a smaller NGRAM tree would have accepted from them).
    accept_paths: Optional[list[list[int]]] = None
    # slime's top-p replay: per request (empty when not asked), each emitted token's nucleus.
    top_p_ids: Optional[list[list[list[int]]]] = None
    # Requests the model failed this step (non-finite logits): index -> why; they emit nothing.
    failed: dict[int, str] = field(default_factory=dict)


class Draw(NamedTuple):
    """A step's draws on the device, before its read: the tokens, the non-finite flags and the
    processed logits (top-p replay reads them after)."""

    drawn: DrawnTokens
    flags: torch.Tensor
    logits: torch.Tensor


@dataclass
class PendingDecode:
    """A plain decode step launched and not yet read back: its requests, their KV lengths
    before it, its sampled tokens on the device, and `finish`, its read (a StepResult)."""

    reqs: list[Req]
    starts: list[int]
    tokens: torch.Tensor
    finish: Callable[[], StepResult]
    # The KV lengths before it are exact on the host, so finished requests may release their KV
    # before it is read (a speculative chain step learns them only at the previous step's read).
    release_unread = True


def resolve_placeholders(ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`ids` with each placeholder -1 - j replaced by tokens[j], on the device."""
    rows = (-1 - ids).clamp(min=0)
    return torch.where(ids < 0, tokens.to(ids.dtype)[rows], ids)


class ModelWorker:
    def __init__(
        self, runner: ModelRunner, alloc_kv: AllocFn, eos_token_ids: frozenset[int]
    ) -> None:
        self.runner = runner
        self.alloc_kv = alloc_kv
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.page_size = runner.args.page_size
        self.device = runner.device
        self.vocab_size = runner.model_config.vocab_size

    # Whether decode steps may overlap (core/overlap.py), and which requests' steps may.
    can_overlap = True

    def overlappable(self, req: Req) -> bool:
        """Whether `req` may be in an overlapped step (beyond core/overlap.overlappable)."""
        return True

    def decode_kv_demand(self, reqs: Sequence[Req], depth: Optional[int] = None) -> int:
        """KV tokens (whole pages) the next decode step of `reqs` at `depth` (see `decode`) will
        allocate."""
        return self.page_size * sum(1 for r in reqs if r.kv_len % self.page_size == 0)

    def decode_headroom(self) -> int:
        """KV tokens a request may hold during a decode step beyond its own sequence (drafts)."""
        return 0

    def release(self, req: Req) -> int:
        """Drop what the worker keeps for `req` between steps (its KV is being released).
        Returns how many leading positions hold KV the prefix cache may share: all it computed,
        unless a draft model lags behind them (speculative/draft_lag.py)."""
        return req.kv_len

    def prefill(self, reqs: Sequence[Req]) -> StepResult:
        """Compute KV for each request's next `extend_len` tokens; sample where the prompt ends."""
        return self._prefill(reqs)[0]

    def _prefill(
        self, reqs: Sequence[Req], capture_hidden: bool = False
    ) -> tuple[StepResult, ForwardOutput, list[int], list[int]]:
        starts = [r.kv_len for r in reqs]
        ends = [r.kv_len + r.extend_len for r in reqs]
        out_loc = self._alloc(reqs, starts, ends)
        input_ids, positions, logits_rows, done, sample_rows = [], [], [], [], []
        scored: list[tuple[Req, list[int]]] = []  # (request, its logits rows for prompt tokens)
        offset = 0
        for i, (r, s, e) in enumerate(zip(reqs, starts, ends)):
            input_ids.extend(r.fill_ids[s:e])
            positions.extend(range(s, e))
            # Prompt log-probs: the positions still to score that this chunk computes (the
            # scheduler reused no cached KV past the first of them).
            todo = r.positions_to_score()
            first, last = todo.start, min(e, todo.stop)
            if s <= first < last:
                scored.append((r, list(range(len(logits_rows), len(logits_rows) + last - first))))
                logits_rows.extend(range(offset + first - s, offset + last - s))
            offset += e - s
            if e == r.seq_len:
                sample_rows.append(len(logits_rows))
                logits_rows.append(offset - 1)
                done.append(i)
        ids_t, positions_t, pool_t, ends_t, rows_t = self._upload(
            input_ids, positions, [r.req_pool_idx for r in reqs], ends, logits_rows
        )
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=ids_t,
            positions=positions_t,
            out_cache_loc=out_loc,
            req_pool_indices=pool_t,
            seq_lens=ends_t,
            seq_lens_cpu=ends,
            extend_seq_lens_cpu=[r.extend_len for r in reqs],
            extend_prefix_lens_cpu=starts,
            logits_indices=rows_t,
            capture_hidden=capture_hidden,
        )
        out = self.runner.forward(batch)
        for r, e in zip(reqs, ends):
            r.kv_len = e
            r.extend_len = 0
        result = StepResult(tokens=[[] for _ in reqs])
        logits = out.logits
        if scored:
            self._score_prompt(logits, scored)
            logits = logits[self._tensor(sample_rows)]
        if done:
            self._sample_into(result, logits, [reqs[i] for i in done], done)
        return result, out, starts, ends

    def decode(self, reqs: Sequence[Req], depth: Optional[int] = None) -> StepResult:
        """One decode step. `depth`: how a speculative worker decodes this step (None: its
        configured shape, 0: plainly, else the depth of one of its shapes); plain decoding has
        one shape, the single token."""
        return self._decode(reqs)[0]

    def _decode(
        self, reqs: Sequence[Req], capture_hidden: bool = False
    ) -> tuple[StepResult, ForwardOutput]:
        out = self._forward_decode(reqs, [r.output_ids[-1] for r in reqs], capture_hidden)
        result = StepResult(tokens=[[] for _ in reqs])
        self._sample_into(result, out.logits, reqs, range(len(reqs)))
        return result, out

    def launch_decode(
        self, reqs: Sequence[Req], previous: Optional[PendingDecode] = None
    ) -> PendingDecode:
        """A plain decode step launched without reading its tokens back (core/overlap.py). A
        request of `previous`, the step still in flight, takes its input id from that step's
        sampled tokens on the device (SGLang's FutureMap: a negative placeholder, gathered)."""
        rows = {id(r): j for j, r in enumerate(previous.reqs)} if previous is not None else {}
        ids = [-1 - rows[id(r)] if id(r) in rows else r.output_ids[-1] for r in reqs]
        starts = [r.kv_len for r in reqs]
        out = self._forward_decode(reqs, ids, placeholders=previous.tokens if rows else None)
        # A request of `previous` has one token in flight: it counts for its seed and bans.
        draw = self._draw(out.logits, reqs, [1 if id(r) in rows else 0 for r in reqs])
        result = StepResult(tokens=[[] for _ in reqs])

        def finish() -> StepResult:
            self._read_into(result, draw, reqs, range(len(reqs)))
            return result

        return PendingDecode(list(reqs), starts, draw[0].token_ids, finish)

    def _forward_decode(
        self,
        reqs: Sequence[Req],
        input_ids: list[int],
        capture_hidden: bool = False,
        placeholders: Optional[torch.Tensor] = None,
    ) -> ForwardOutput:
        """`input_ids`: the host ids, placeholders -1 - j standing for `placeholders[j]` (the
        step in flight's tokens on the device)."""
        starts = [r.kv_len for r in reqs]
        ends = [s + 1 for s in starts]
        out_loc = self._alloc(reqs, starts, ends)
        ids, positions, pool_rows, seq_lens = self._upload(
            input_ids, starts, [r.req_pool_idx for r in reqs], ends
        )
        if placeholders is not None:
            ids = resolve_placeholders(ids, placeholders)
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=ids,
            positions=positions,
            out_cache_loc=out_loc,
            req_pool_indices=pool_rows,
            seq_lens=seq_lens,
            seq_lens_cpu=ends,
            capture_hidden=capture_hidden,
        )
        out = self.runner.forward(batch)
        for r in reqs:
            r.kv_len += 1
        return out

    def _score_prompt(self, logits: torch.Tensor, scored: list[tuple[Req, list[int]]]) -> None:
        """Log-probs (and top log-probs) of prompt tokens at each request's temperature."""
        for req, rows in scored:
            t = req.input.sampling_params.logit_scale
            first = req.positions_to_score().start
            targets = self._tensor(
                list(req.input.origin_input_ids[first + 1 : first + 1 + len(rows)])
            )
            logp = torch.log_softmax(logits[self._tensor(rows)] / t, -1)
            req.input_logprobs.extend(logp.gather(1, targets[:, None]).squeeze(1).tolist())
            if req.input.top_logprobs_num:
                vals, ids = logp.topk(req.input.top_logprobs_num, dim=-1)
                req.input_top_logprobs.extend(
                    list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist())
                )
            if req.input.token_ids_logprob:
                chosen = self._tensor(list(req.input.token_ids_logprob))
                req.input_token_ids_logprobs.extend(logp[:, chosen].tolist())

    def _alloc(self, reqs: Sequence[Req], starts: list[int], ends: list[int]) -> torch.Tensor:
        """Slots for positions starts[i] .. ends[i] - 1 of each request, in its table row; the
        device slots, request after request."""
        table = self.runner.req_to_token_pool
        last_slots = [0] * len(reqs)
        if self.page_size > 1:  # the slot before each unaligned start, from the host mirror
            for i, s in enumerate(starts):
                if s % self.page_size:
                    last_slots[i] = int(table.host[reqs[i].req_pool_idx, s - 1])
        slots = self.alloc_kv(starts, ends, last_slots)
        table.write_ranges([r.req_pool_idx for r in reqs], starts, ends, slots.device, slots.host)
        return slots.device

    def _sample_into(
        self, result: StepResult, logits: torch.Tensor, reqs: Sequence[Req], rows: Sequence[int]
    ) -> None:
        """Sample one token per logits row; row j belongs to request rows[j] of the result."""
        self._read_into(result, self._draw(logits, reqs), reqs, rows)

    def _draw(self, logits: torch.Tensor, reqs: Sequence[Req], ahead: Sequence[int] = ()) -> Draw:
        """Process the logits and draw on the device (nothing read); `ahead`: per request, its
        tokens sampled but not yet appended (an overlapped step's)."""
        params = [r.input.sampling_params for r in reqs]
        detect = self.runner.args.enable_nan_detection
        logits, flags = replace_nan(logits) if detect else (logits, nonfinite_flags(logits))
        logits = process_logits(logits, params, [r.output_ids for r in reqs])
        logits = mask_rows(logits, [r.grammar for r in reqs])
        logits = apply_processors(logits, reqs, [r.output_ids for r in reqs])
        batch = sampling_batch(reqs, self.vocab_size, self.device, self.eos_token_ids, ahead)
        return Draw(self.sampler.draw(logits, batch), flags, logits)

    def _read_into(
        self, result: StepResult, draw: Draw, reqs: Sequence[Req], rows: Sequence[int]
    ) -> None:
        """Read the draws back (the step's one read) into request rows[j] of the result."""
        params = [r.input.sampling_params for r in reqs]
        logits = draw.logits
        # The step's one read: tokens, flags and asked log-probs together.
        sampled, bad = read_sample(draw.drawn, draw.flags)
        if self.runner.args.enable_nan_detection:
            warn_nan(bad)
        else:
            for j in (j for j, b in enumerate(bad) if b):
                result.failed[rows[j]] = NONFINITE_LOGITS
        replay = [j for j, sp in enumerate(params) if wants_top_p_replay(sp)]
        if replay:
            result.top_p_ids = [[] for _ in result.tokens]
            nuclei, renormed = top_p_replay(
                logits[self._tensor(replay)],
                [params[j] for j in replay],
                [sampled.token_ids[j] for j in replay],
            )
            for j, nucleus, lp in zip(replay, nuclei, renormed):
                result.top_p_ids[rows[j]].append(nucleus)
                if sampled.logprobs is not None:
                    sampled.logprobs[j] = lp
        if sampled.logprobs is not None:
            result.logprobs = [[] for _ in result.tokens]
        if sampled.top_logprobs is not None:
            result.top_logprobs = [[] for _ in result.tokens]
        if sampled.token_ids_logprobs is not None:
            result.token_ids_logprobs = [[] for _ in result.tokens]
        for j, i in enumerate(rows):
            result.tokens[i].append(sampled.token_ids[j])
            if sampled.logprobs is not None:
                result.logprobs[i].append(sampled.logprobs[j])
            if sampled.top_logprobs is not None:
                result.top_logprobs[i].append(
                    sampled.top_logprobs[j][: reqs[j].input.top_logprobs_num]
                )
            if sampled.token_ids_logprobs is not None:
                chosen = sampled.token_ids_logprobs[j][: len(reqs[j].input.token_ids_logprob)]
                result.token_ids_logprobs[i].append(chosen)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return self._upload(values)[0]

    def _upload(self, *values: Sequence[int]) -> list[torch.Tensor]:
        """Int64 tensors of host values on the worker's device, in one copy (mem/upload.py)."""
        return upload(self.device, *((v, torch.int64) for v in values))


def read_sample(drawn: DrawnTokens, flags: torch.Tensor) -> tuple[SampleOutput, list[int]]:
    """The draws and a [B] flag tensor on the host in one read (core.readback)."""
    tokens, bad, logprobs, values, ids, chosen = read_back(
        drawn.token_ids,
        flags,
        drawn.logprobs,
        drawn.top_values,
        drawn.top_ids,
        drawn.token_ids_values,
    )
    top = None
    if values is not None:
        k = drawn.top_values.shape[-1]
        top = [list(zip(values[r : r + k], ids[r : r + k])) for r in range(0, len(values), k)]
    if chosen is not None:
        k = drawn.token_ids_values.shape[-1]
        chosen = [chosen[r : r + k] for r in range(0, len(chosen), k)]
    return SampleOutput(tokens, logprobs, top, chosen), bad


def sampling_batch(
    reqs: Sequence[Req],
    vocab_size: int,
    device: torch.device,
    eos_token_ids: frozenset[int] = frozenset(),
    ahead: Sequence[int] = (),
) -> SamplingBatch:
    """The requests' sampling parameters as one batch of tensors (built once per step);
    `ahead`: per request, tokens sampled in flight but not yet in its output_ids."""
    temps, ks, ps, mins, uniforms, plain, filtered = [], [], [], [], [], [], []
    banned_rows, banned_ids = [], []
    for i, req in enumerate(reqs):
        n = ahead[i] if ahead else 0
        for t in req.banned_tokens(eos_token_ids, n):
            banned_rows.append(i)
            banned_ids.append(t)
        sp = req.input.sampling_params
        temps.append(sp.logit_scale)
        k = vocab_size if sp.top_k < 0 else min(sp.top_k, vocab_size)
        ks.append(k)
        ps.append(sp.top_p)
        mins.append(sp.min_p)
        greedy = sp.is_greedy
        uniforms.append(0.0 if greedy else request_uniform(req.input.seed, len(req.output_ids) + n))
        if not greedy:
            (filtered if k < vocab_size or sp.top_p < 1.0 or sp.min_p > 0.0 else plain).append(i)

    chosen_width = max((len(r.input.token_ids_logprob) for r in reqs), default=0)
    # Padded with id 0; each row's own ids are cut out after the read.
    padded = [
        [*r.input.token_ids_logprob, *[0] * (chosen_width - len(r.input.token_ids_logprob))]
        for r in reqs
    ]
    int64, f32 = torch.int64, torch.float32
    temps_t, ks_t, ps_t, mins_t, uniforms_t, plain_t, filtered_t, ban_rows, ban_ids, chosen = (
        upload(
            device,
            (temps, f32),
            (ks, int64),
            (ps, f32),
            (mins, f32),
            (uniforms, torch.float64),
            (plain, int64),
            (filtered, int64),
            (banned_rows, int64),
            (banned_ids, int64),
            (padded, int64),
        )
    )
    return SamplingBatch(
        temperatures=temps_t,
        top_ks=ks_t,
        top_ps=ps_t,
        min_ps=mins_t,
        uniforms=uniforms_t,
        all_greedy=not plain and not filtered,
        unit_temperature=all(t == 1.0 for t in temps),
        plain_rows=plain_t if plain else None,
        filter_rows=filtered_t if filtered else None,
        need_logprobs=any(r.input.return_logprob for r in reqs),
        top_logprobs_num=max((r.input.top_logprobs_num for r in reqs), default=0),
        banned=(ban_rows, ban_ids) if banned_rows else None,
        filter_k_max=max((ks[i] for i in filtered), default=None),
        token_ids=chosen.view(len(reqs), chosen_width) if chosen_width else None,
    )
