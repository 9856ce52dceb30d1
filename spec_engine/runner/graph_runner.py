"""GraphRunner: one forward mode at a fixed list of batch sizes, with padding into static buffers.

A batch of b requests runs as the smallest captured size B >= b. The B - b padded requests, and
the padded token rows of a request with fewer tokens than the mode's width, are inert by
construction:
  * they write K/V only to the reserved dummy slot 0 and read through the reserved dummy
    table row (all zeros), so no real slot is touched;
  * their positions are 0 (never a stale, growing value) and their sequence length is the fill
    value, so every index stays in range;
  * their attention mask rows are non-empty (no NaN rows), real rows never see a padded key;
  * their outputs are dropped before anyone reads them.
Every size is captured once over views of the static buffers (largest first, one memory pool):
a CUDA graph on CUDA, its emulation on CPU (spec_engine.runner.graph_capture), so the padding and
replay path the CPU tests exercise is the one a GPU replays. Before a replay the batch is
copied into the buffers and the attention backend refills its static metadata; outputs are
copied out of graph memory. Batches larger than the largest size, or (with
--disable-cuda-graph-padding) of a size not in the list, run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch

from spec_engine.forward_batch import ForwardBatch, ForwardMode, causal_mask
from spec_engine.runner.graph_capture import Outputs, capture
from spec_engine.mem.allocator import PageAllocator
from spec_engine.mem.kv_pool import KVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 256
SEQ_LEN_FILL = 1  # a padded decode row attends to one key: the dummy slot
DUMMY_SLOT = 0


def default_capture_sizes(max_bs: int) -> list[int]:
    """Dense where batches spend their time (1..8), then steps of 2 to 32, 4 to 64, 8 to 256 and
    16 beyond; `max_bs` itself is always included so every batch up to it has a size."""
    sizes = list(range(1, min(8, max_bs) + 1))
    size = sizes[-1]
    while size < max_bs:
        size += 2 if size < 32 else 4 if size < 64 else 8 if size < 256 else 16
        sizes.append(min(size, max_bs))
    return sizes


def capture_sizes(cuda_graph_bs: Optional[Sequence[int]], cuda_graph_max_bs: Optional[int],
                  max_running_requests: int) -> list[int]:
    """The capture list: `--cuda-graph-bs` (deduplicated, sorted) or the default list up to
    `--cuda-graph-max-bs` (auto: min(max running requests, 256)). Sizes above the running
    limit could never run and are dropped, as in SGLang."""
    if cuda_graph_bs:
        sizes = sorted(set(cuda_graph_bs))
    else:
        sizes = default_capture_sizes(cuda_graph_max_bs or min(max_running_requests, DEFAULT_MAX_BS))
    kept = [s for s in sizes if s <= max_running_requests]
    if not kept:
        raise ValueError(f"every --cuda-graph-bs size ({sizes}) exceeds --max-running-requests "
                         f"{max_running_requests}; give sizes up to it")
    return kept


# A forward over (batch, features) returning its outputs at the batch's logits rows; the
# captured one reads the attention metadata already on the batch.
ForwardFn = Callable[[ForwardBatch, Optional[torch.Tensor]], Outputs]


@dataclass
class Padded:
    """A padded batch (host-side fields included, for the metadata refill) and how to get the
    real rows back out of its outputs."""

    batch: ForwardBatch
    features: Optional[torch.Tensor]
    size: int                       # the captured size it replays
    token_rows: torch.Tensor        # padded row of every real token, in the original order
    out_rows: torch.Tensor          # output row of every real logits row, in the original order

    def rows(self, out: torch.Tensor) -> torch.Tensor:
        """Outputs at the padded logits rows -> a copy (out of graph memory) at the original's."""
        return out.index_select(0, self.out_rows)


class GraphRunner:
    """Sizes, static buffers, padding and captured graphs for one forward mode.

    `width`: token rows per request (1 for decode, topk for draft steps, the verify or draft
    extend width for TARGET_VERIFY / DRAFT_EXTEND, whose requests carry up to `width` query
    tokens each over a prefix; in DECODE every row is its own decode row).
    `feature_dim`: width of the per-token input features (draft models), None without.
    `kv_rows`: decode rows that carry their own KV indices (draft tree steps) of up to
    `kv_width` keys. DRAFT_EXTEND batches have one logits row per request; other modes all rows.
    """

    def __init__(self, label: str, mode: ForwardMode, sizes: Sequence[int], width: int, padding: bool,
                 dummy_row: int, device: torch.device, feature_dim: Optional[int] = None,
                 kv_rows: bool = False, dtype: torch.dtype = torch.float32) -> None:
        self.label = label
        self.mode = mode
        self.sizes = list(sizes)
        self.width = width
        self.extend = mode is not ForwardMode.DECODE
        self.per_request_logits = mode is ForwardMode.DRAFT_EXTEND
        self.padding = padding
        self.dummy_row = dummy_row
        self.device = device
        self.feature_dim, self.kv_rows = feature_dim, kv_rows
        rows = self.sizes[-1] * width
        reqs = self.sizes[-1] if self.extend else rows
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.full((rows,), DUMMY_SLOT, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.full((reqs,), dummy_row, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((reqs,), width if self.extend else SEQ_LEN_FILL, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(self.sizes[-1], device=device) * width
        self.dtype = dtype
        self.features = None if feature_dim is None else torch.zeros(rows, feature_dim, dtype=dtype, device=device)
        self.kv_indices: Optional[torch.Tensor] = None
        self.kv_mask: Optional[torch.Tensor] = None
        self.live = False  # graphs captured (or capturable on first use) and not released
        self._graphs: dict[tuple[int, int], tuple[ForwardBatch, Any]] = {}
        self._told: set[str] = set()

    def capture(self, forward: ForwardFn, bind: Callable[[ForwardBatch], None], kv_width: int,
                pool: Any, check_inputs: bool = False) -> None:
        """Capture `forward` at every size, largest first, over views of the static buffers.
        `bind` sets a batch's KV pool, table and attention backend; `kv_width`: the most keys a
        row can attend to; `check_inputs`: see EmulatedGraph. A backend whose graphs have a fixed
        key width (torch_native) gets one graph per (size, width bucket), captured on first use."""
        self.bind, self.forward, self.pool, self.check_inputs, self.kv_width = bind, forward, pool, check_inputs, kv_width
        if self.kv_rows:
            rows = self.sizes[-1] * self.width
            self.kv_indices = torch.full((rows, kv_width), DUMMY_SLOT, dtype=torch.int64, device=self.device)
            self.kv_mask = torch.zeros(rows, kv_width, dtype=torch.bool, device=self.device)
            self.kv_mask[:, 0] = True
        probe = self._static_batch(self.sizes[-1], kv_width)
        bind(probe)
        self.backend = probe.attn_backend
        self._graphs = {}
        self.live = True
        if not self.backend.bucketed_graph_widths:
            for size in reversed(self.sizes):
                self._capture(size, kv_width)

    def _capture(self, size: int, kv_width: int) -> tuple[ForwardBatch, Any]:
        batch = self._static_batch(size, kv_width)
        self.bind(batch)
        batch.attn_meta = self.backend.graph_metadata(batch, kv_width)
        features = None if self.features is None else self.features[:size * self.width]
        graph = capture(lambda b=batch, f=features: self.forward(b, f), f"{self.label} at batch size {size}",
                        self.device, self.pool, self.check_inputs)
        self._graphs[(size, kv_width)] = (batch, graph)
        return batch, graph

    def release(self) -> None:
        """Drop the captured graphs (and their memory); capture() again before run()."""
        self._graphs = {}
        self.live = False

    def run(self, batch: ForwardBatch, features: Optional[torch.Tensor] = None,
            size: Optional[int] = None) -> Optional[list[Optional[torch.Tensor]]]:
        """The batch's outputs from its captured graph, at its own logits rows, or None to run it eagerly."""
        if not self.live:
            return None
        padded = self.pad(batch, features, size)
        if padded is None:
            return None
        needed = batch.kv_indices.shape[1] if self.kv_rows else max(padded.batch.seq_lens_cpu)
        width = self.backend.graph_kv_width(needed, self.kv_width)
        # Captured on first use after pad(): the capture's warm-up writes K/V only to the slots
        # this batch owns (or the dummy slot), which the replay below rewrites.
        static, graph = self._graphs.get((padded.size, width)) or self._capture(padded.size, width)
        self.bind(padded.batch)
        self.backend.fill_graph_metadata(static.attn_meta, padded.batch)
        return [None if out is None else padded.rows(out) for out in graph.replay()]

    def _static_batch(self, size: int, kv_width: int) -> ForwardBatch:
        """The batch a graph is captured with: views of the buffers; its Python fields keep their
        capture-time values, as inside a CUDA graph."""
        rows = size * self.width
        reqs = size if self.extend else rows
        return ForwardBatch(
            mode=self.mode, input_ids=self.input_ids[:rows], positions=self.positions[:rows],
            out_cache_loc=self.out_cache_loc[:rows], req_pool_indices=self.req_pool_indices[:reqs],
            seq_lens=self.seq_lens[:reqs], seq_lens_cpu=[self.width if self.extend else SEQ_LEN_FILL] * reqs,
            extend_seq_lens_cpu=[self.width] * size if self.extend else None,
            extend_prefix_lens_cpu=[0] * size if self.extend else None,
            logits_indices=self.logits_indices[:size] if self.per_request_logits else None,
            kv_indices=self.kv_indices[:rows, :kv_width] if self.kv_rows else None,
            kv_mask=self.kv_mask[:rows, :kv_width] if self.kv_rows else None,
            capture_hidden=True,
        )

    def num_requests(self, batch: ForwardBatch) -> int:
        return batch.batch_size if self.extend else batch.batch_size // self.width

    def padded_size(self, num_reqs: int) -> Optional[int]:
        """The size a batch of `num_reqs` requests replays, or None to run it eagerly."""
        if num_reqs > self.sizes[-1]:
            self._tell("above", f"{self.label}: batches above {self.sizes[-1]} requests (the largest "
                       "--cuda-graph-bs size) run eagerly")
            return None
        if not self.padding:
            return num_reqs if num_reqs in self.sizes else None
        return self.sizes[bisect.bisect_left(self.sizes, num_reqs)]

    def pad(self, batch: ForwardBatch, features: Optional[torch.Tensor] = None,
            size: Optional[int] = None) -> Optional[Padded]:
        """The batch padded to its captured size in the static buffers, or None to run eagerly."""
        if (batch.kv_indices is not None) != self.kv_rows or (batch.logits_indices is not None) != (
                self.per_request_logits) or (features is None) != (self.feature_dim is None):
            self._tell("shape", f"{self.label}: a batch unlike the captured ones runs eagerly")
            return None
        if self.per_request_logits and len(batch.logits_indices) != batch.batch_size:
            self._tell("logits", f"{self.label}: a batch without one logits row per request runs eagerly")
            return None
        size = size or self.padded_size(self.num_requests(batch))
        if size is None:
            return None
        if self.extend:
            if max(batch.extend_seq_lens_cpu) > self.width:
                self._tell("wide", f"{self.label}: a request with more than {self.width} tokens runs eagerly")
                return None
            return self._pad_extend(batch, features, size)
        return self._pad_decode(batch, features, size)

    def _pad_decode(self, batch: ForwardBatch, features: Optional[torch.Tensor], size: int) -> Padded:
        n, rows = batch.num_tokens, size * self.width
        ids, pos, loc = self.input_ids[:rows], self.positions[:rows], self.out_cache_loc[:rows]
        rpi, lens = self.req_pool_indices[:rows], self.seq_lens[:rows]
        ids[:n], ids[n:] = batch.input_ids, 0
        pos[:n], pos[n:] = batch.positions, 0
        loc[:n], loc[n:] = batch.out_cache_loc, DUMMY_SLOT
        rpi[:n], rpi[n:] = batch.req_pool_indices, self.dummy_row
        lens[:n], lens[n:] = batch.seq_lens, SEQ_LEN_FILL
        kv_idx = kv_ok = None
        if self.kv_rows:
            kv_idx, kv_ok = self.kv_indices[:rows], self.kv_mask[:rows]
            width = batch.kv_indices.shape[1]
            if width > kv_idx.shape[1]:
                raise RuntimeError(f"{self.label}: a row attends to {width} keys, more than the {kv_idx.shape[1]} "
                                   "the graphs were captured for; this is a bug, run with --disable-cuda-graph")
            kv_idx[:n, :width], kv_idx[:n, width:] = batch.kv_indices, DUMMY_SLOT
            kv_ok[:n, :width], kv_ok[:n, width:] = batch.kv_mask, False
            kv_idx[n:] = DUMMY_SLOT
            kv_ok[n:] = False
            kv_ok[n:, 0] = True
            kv_idx, kv_ok = kv_idx[:, :width], kv_ok[:, :width]  # the metadata refill reads the batch's own width
        padded = replace(batch, input_ids=ids, positions=pos, out_cache_loc=loc, req_pool_indices=rpi,
                         seq_lens=lens, seq_lens_cpu=list(batch.seq_lens_cpu) + [SEQ_LEN_FILL] * (rows - n),
                         kv_indices=kv_idx, kv_mask=kv_ok)
        token_rows = torch.arange(n, device=self.device)
        return self._finish(batch, padded, features, token_rows, size)

    def _pad_extend(self, batch: ForwardBatch, features: Optional[torch.Tensor], size: int) -> Padded:
        b, w, rows = batch.batch_size, self.width, size * self.width
        q_lens, prefixes = batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu
        token_rows = torch.cat([torch.arange(i * w, i * w + q, device=self.device) for i, q in enumerate(q_lens)])
        ids, pos, loc = self.input_ids[:rows], self.positions[:rows], self.out_cache_loc[:rows]
        for buf, src in ((ids, batch.input_ids), (pos, batch.positions), (loc, batch.out_cache_loc)):
            buf.zero_()  # DUMMY_SLOT and position 0 for every padded row
            buf.index_copy_(0, token_rows, src)
        rpi, lens = self.req_pool_indices[:size], self.seq_lens[:size]
        rpi[:b], rpi[b:] = batch.req_pool_indices, self.dummy_row
        seq_lens_cpu = [p + w for p in prefixes] + [w] * (size - b)
        lens.copy_(torch.tensor(seq_lens_cpu, device=self.device))
        masks = []
        for i, (q, p) in enumerate(zip(q_lens, prefixes)):
            mask = torch.zeros(w, p + w, dtype=torch.bool, device=self.device)
            real = batch.custom_masks[i] if batch.custom_masks is not None else causal_mask(p, p + q, self.device)
            mask[:q, :p + q] = real
            mask[q:, 0] = True  # padded queries of a real request: one real key, output dropped
            masks.append(mask)
        masks.extend(torch.ones(w, w, dtype=torch.bool, device=self.device) for _ in range(size - b))
        padded = replace(batch, input_ids=ids, positions=pos, out_cache_loc=loc, req_pool_indices=rpi,
                         seq_lens=lens, seq_lens_cpu=seq_lens_cpu, extend_seq_lens_cpu=[w] * size,
                         extend_prefix_lens_cpu=list(prefixes) + [0] * (size - b), custom_masks=masks)
        return self._finish(batch, padded, features, token_rows, size)

    def _finish(self, batch: ForwardBatch, padded: ForwardBatch, features: Optional[torch.Tensor],
                token_rows: torch.Tensor, size: int) -> Padded:
        out_rows = token_rows
        if self.per_request_logits:
            b = batch.batch_size
            logits = self.logits_indices[:size]
            logits[:b] = token_rows.index_select(0, batch.logits_indices)
            logits[b:] = torch.arange(b, size, device=self.device) * self.width  # a padded request's first row
            padded.logits_indices = logits
            out_rows = torch.arange(b, device=self.device)
        padded_features = None
        if features is not None:
            padded_features = self.features[:size * self.width]
            padded_features.zero_()
            padded_features.index_copy_(0, token_rows, features.to(padded_features.dtype))
        return Padded(padded, padded_features, size, token_rows, out_rows)

    def _tell(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            logger.info(message)


class SelfCheckBatches:
    """Synthetic batches for the startup self-check, over freshly allocated KV slots: every
    request reads two shared context slots holding random K/V and writes slots of its own.
    Runs before any request exists (all table rows and slots are free); close() gives them back."""

    CONTEXT = 2

    def __init__(self, table: ReqToTokenPool, allocator: PageAllocator, pools: Sequence[KVPool],
                 vocab_size: int, device: torch.device) -> None:
        self.table, self.allocator, self.vocab_size, self.device = table, allocator, vocab_size, device
        self.gen = torch.Generator(device="cpu").manual_seed(0)
        self._slots: list[torch.Tensor] = []
        self._rows: set[int] = set()
        self.context = self._alloc(self.CONTEXT)
        for pool in pools:
            for buf in pool.k_buffer + pool.v_buffer:
                buf[self.context] = torch.randn(buf[self.context].shape, generator=self.gen).to(buf.dtype)

    def make(self, g: GraphRunner, num: int, feature_dim: Optional[int],
             kv_rows: bool = False) -> tuple[ForwardBatch, Optional[torch.Tensor]]:
        """A batch of `num` requests for `g`'s mode; `kv_rows`: draft-step rows that carry their
        own KV indices instead of a table row."""
        c = self.CONTEXT
        if g.extend:
            q = max(g.width - 1, 1)  # one short of the width, so token padding runs as well
            own = self._alloc(num * q).view(num, q)
            rows = self._table_rows(num, own)
            masks = None
            if g.mode is ForwardMode.TARGET_VERIFY:
                # A tree: each query sees the context, itself and a random subset of earlier nodes.
                tree = torch.rand(q, q, generator=self.gen) < 0.5
                tree = (tree.tril(-1) | torch.eye(q, dtype=torch.bool)).to(self.device)
                masks = [torch.cat((torch.ones(q, c, dtype=torch.bool, device=self.device), tree), 1)] * num
            batch = ForwardBatch(
                mode=g.mode, input_ids=self._ids(num * q), positions=torch.arange(c, c + q, device=self.device).repeat(num),
                out_cache_loc=own.reshape(-1), req_pool_indices=rows, seq_lens=torch.full((num,), c + q, device=self.device),
                seq_lens_cpu=[c + q] * num, extend_seq_lens_cpu=[q] * num, extend_prefix_lens_cpu=[c] * num,
                custom_masks=masks,
                logits_indices=None if masks is not None else torch.arange(q - 1, num * q, q, device=self.device),
            )
            tokens = num * q
        else:
            n = num * g.width
            own = self._alloc(n)
            kv_idx = kv_ok = None
            if kv_rows:
                kv_idx = torch.cat((self.context.expand(n, c), own[:, None]), 1)
                kv_ok = torch.ones(n, c + 1, dtype=torch.bool, device=self.device)
                rows = torch.full((n,), g.dummy_row, dtype=torch.int64, device=self.device)
            else:
                rows = self._table_rows(n, own[:, None])
            batch = ForwardBatch(
                mode=g.mode, input_ids=self._ids(n), positions=torch.full((n,), c, device=self.device),
                out_cache_loc=own, req_pool_indices=rows, seq_lens=torch.full((n,), c + 1, device=self.device),
                seq_lens_cpu=[c + 1] * n, kv_indices=kv_idx, kv_mask=kv_ok,
            )
            tokens = n
        features = None
        if feature_dim is not None:
            features = torch.randn(tokens, feature_dim, generator=self.gen).to(self.device)
        return batch, features

    def close(self) -> None:
        for row in self._rows:
            self.table.req_to_token[row].zero_()
        for slots in self._slots:
            self.allocator.free(slots)
        self._slots, self._rows = [], set()

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.allocator.alloc([0], [n], [0])
        if slots is None:
            raise ValueError(f"--cuda-graph-self-check needs {n} free KV slots for its test batches; raise "
                             "--max-total-tokens or lower the largest --cuda-graph-bs size")
        self._slots.append(slots)
        return slots

    def _table_rows(self, n: int, own: torch.Tensor) -> torch.Tensor:
        if n > self.table.size:
            raise ValueError(f"--cuda-graph-self-check needs {n} request rows; lower the largest --cuda-graph-bs "
                             f"size to --max-running-requests ({self.table.size}) or below")
        for row in range(n):
            self.table.write(row, 0, torch.cat((self.context, own[row])))
            self._rows.add(row)
        return torch.arange(n, device=self.device)

    def _ids(self, n: int) -> torch.Tensor:
        return torch.randint(self.vocab_size, (n,), generator=self.gen).to(self.device)


def build_graph_runners(args: Any, max_running_requests: int, dummy_row: int, device: torch.device,
                        dtype: torch.dtype, specs: dict[Any, tuple[str, ForwardMode, int, Optional[int], bool]]) -> dict[Any, GraphRunner]:
    """One GraphRunner per {key: (label, mode, width, feature_dim, kv_rows)}, all on the capture list from `args`."""
    sizes = capture_sizes(args.cuda_graph_bs, args.cuda_graph_max_bs, max_running_requests)
    return {key: GraphRunner(label, mode, sizes, width, not args.disable_cuda_graph_padding, dummy_row, device,
                             feature_dim, kv_rows, dtype)
            for key, (label, mode, width, feature_dim, kv_rows) in specs.items()}


def self_check(runners: Sequence[GraphRunner], forward: ForwardFn, batches: SelfCheckBatches, atol: float) -> None:
    """Replay every size of every runner on a synthetic batch one request short of it (padding
    runs) and compare with the eager forward; raise naming the size and mode on a mismatch
    (--cuda-graph-self-check at startup). Gives the batches' slots and rows back at the end."""
    try:
        for g in runners:
            for size in g.sizes:
                num = size - 1 if g.padding and size > 1 else size
                batch, features = batches.make(g, num, g.feature_dim, g.kv_rows)
                eager = forward(batch, features)
                replayed = g.run(batch, features, size=size)
                for name, want, got in zip(("logits", "features"), eager, replayed):
                    err = (got.float() - want.float()).abs().max().item()
                    if not err <= atol:
                        raise RuntimeError(f"CUDA-graph self-check failed: {g.label} at batch size {size} "
                                           f"({num} real requests) differs from eager in {name} by {err:.3g} "
                                           f"(tolerance {atol}); run with --disable-cuda-graph and report this")
    finally:
        batches.close()
