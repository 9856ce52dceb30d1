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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from spec_engine.forward_batch import ForwardBatch, ForwardMode, padded_masks
from spec_engine.mem.upload import upload
from spec_engine.runner.graph_capture import Outputs, capture

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


def capture_sizes(
    cuda_graph_bs: Optional[Sequence[int]],
    cuda_graph_max_bs: Optional[int],
    max_running_requests: int,
) -> list[int]:
    """The capture list: `--cuda-graph-bs` (deduplicated, sorted) or the default list up to
    `--cuda-graph-max-bs` (auto: min(max running requests, 256)). Sizes above the running
    limit could never run and are dropped, as in SGLang."""
    if cuda_graph_bs:
        sizes = sorted(set(cuda_graph_bs))
    else:
        sizes = default_capture_sizes(
            cuda_graph_max_bs or min(max_running_requests, DEFAULT_MAX_BS)
        )
    kept = [s for s in sizes if s <= max_running_requests]
    if not kept:
        raise ValueError(
            f"every --cuda-graph-bs size ({sizes}) exceeds --max-running-requests "
            f"{max_running_requests}; give sizes up to it"
        )
    return kept


# A forward over (batch, features) returning its outputs at the batch's logits rows; the
# captured one reads the attention metadata already on the batch.
ForwardFn = Callable[[ForwardBatch, Optional[torch.Tensor]], Outputs]


@dataclass(frozen=True)
class GraphSpec:
    """What one graph runner captures: a forward mode at a fixed number of token rows per request.

    `width`: token rows per request (1 for decode, topk for draft tree steps, the verify or draft
    extend width for TARGET_VERIFY / DRAFT_EXTEND, whose requests carry up to `width` query
    tokens each over a prefix; in DECODE every row is its own decode row).
    `feature_dim`: width of the per-token input features (draft models), None without.
    `kv_rows`: decode rows that carry their own KV indices (draft tree steps), attending to up to
    `extra_keys` keys beyond a request's context (its path in the tree).
    """

    label: str
    mode: ForwardMode
    width: int
    feature_dim: Optional[int] = None
    kv_rows: bool = False
    extra_keys: int = 0

    def matches(self, batch: ForwardBatch) -> bool:
        """Whether `batch` is of this spec's kind (its mode, and KV indices of its own or not)."""
        return batch.mode is self.mode and (batch.kv_indices is not None) == self.kv_rows


@dataclass
class Padded:
    """A padded batch (host-side fields included, for the metadata refill) and how to get the
    real rows back out of its outputs."""

    batch: ForwardBatch
    features: Optional[torch.Tensor]
    size: int  # the captured size it replays
    token_rows: torch.Tensor  # padded row of every real token, in the original order
    out_rows: torch.Tensor  # output row of every real logits row, in the original order

    def rows(self, out: torch.Tensor) -> torch.Tensor:
        """Outputs at the padded logits rows -> a copy (out of graph memory) at the original's."""
        return out.index_select(0, self.out_rows)


class GraphRunner:
    """Sizes, static buffers, padding and captured graphs for one GraphSpec. DRAFT_EXTEND
    batches have one logits row per request; other modes have logits at every row."""

    def __init__(
        self,
        spec: GraphSpec,
        sizes: Sequence[int],
        padding: bool,
        dummy_row: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.spec = spec
        self.label, self.mode, self.width = spec.label, spec.mode, spec.width
        self.feature_dim, self.kv_rows = spec.feature_dim, spec.kv_rows
        self.sizes = list(sizes)
        self.extend = spec.mode is not ForwardMode.DECODE
        self.per_request_logits = spec.mode is ForwardMode.DRAFT_EXTEND
        self.padding = padding
        self.dummy_row = dummy_row
        self.device = device
        width = spec.width
        rows = self.sizes[-1] * width
        reqs = self.sizes[-1] if self.extend else rows
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.full((rows,), DUMMY_SLOT, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.full((reqs,), dummy_row, dtype=torch.int64, device=device)
        self.seq_lens = torch.full(
            (reqs,), width if self.extend else SEQ_LEN_FILL, dtype=torch.int64, device=device
        )
        self.logits_indices = torch.arange(self.sizes[-1], device=device) * width
        self.dtype = dtype
        self.features = (
            None
            if spec.feature_dim is None
            else torch.zeros(rows, spec.feature_dim, dtype=dtype, device=device)
        )
        self.kv_indices: Optional[torch.Tensor] = None
        self.kv_mask: Optional[torch.Tensor] = None
        self.live = False  # graphs captured (or capturable on first use) and not released
        self._graphs: dict[tuple[int, int], tuple[ForwardBatch, Any]] = {}
        self._told: set[str] = set()

    def capture(
        self,
        forward: ForwardFn,
        bind: Callable[[ForwardBatch], None],
        context_len: int,
        pool: Any,
        check_inputs: bool = False,
    ) -> None:
        """Capture `forward` at every size, largest first, over views of the static buffers.
        `bind` sets a batch's KV pool, table and attention backend; `context_len`: the most keys
        a request's row of the table holds; `check_inputs`: see EmulatedGraph. A backend whose
        graphs have a fixed key width (torch_native) gets one graph per (size, width bucket),
        captured on first use."""
        kv_width = context_len + self.spec.extra_keys
        self.bind, self.forward, self.pool, self.check_inputs, self.kv_width = (
            bind,
            forward,
            pool,
            check_inputs,
            kv_width,
        )
        if self.kv_rows:
            rows = self.sizes[-1] * self.width
            self.kv_indices = torch.full(
                (rows, kv_width), DUMMY_SLOT, dtype=torch.int64, device=self.device
            )
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
        features = None if self.features is None else self.features[: size * self.width]
        graph = capture(
            lambda b=batch, f=features: self.forward(b, f),
            f"{self.label} at batch size {size}",
            self.device,
            self.pool,
            self.check_inputs,
        )
        self._graphs[(size, kv_width)] = (batch, graph)
        return batch, graph

    def release(self) -> None:
        """Drop the captured graphs (and their memory); capture() again before run()."""
        self._graphs = {}
        self.live = False

    def run(
        self,
        batch: ForwardBatch,
        features: Optional[torch.Tensor] = None,
        size: Optional[int] = None,
    ) -> Optional[list[Optional[torch.Tensor]]]:
        """The batch's outputs from its captured graph, at its own logits rows, or None to run it
        eagerly."""
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
            mode=self.mode,
            input_ids=self.input_ids[:rows],
            positions=self.positions[:rows],
            out_cache_loc=self.out_cache_loc[:rows],
            req_pool_indices=self.req_pool_indices[:reqs],
            seq_lens=self.seq_lens[:reqs],
            seq_lens_cpu=[self.width if self.extend else SEQ_LEN_FILL] * reqs,
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
            self._tell(
                "above",
                f"{self.label}: batches above {self.sizes[-1]} requests (the largest "
                "--cuda-graph-bs size) run eagerly",
            )
            return None
        if not self.padding:
            return num_reqs if num_reqs in self.sizes else None
        return self.sizes[bisect.bisect_left(self.sizes, num_reqs)]

    def pad(
        self,
        batch: ForwardBatch,
        features: Optional[torch.Tensor] = None,
        size: Optional[int] = None,
    ) -> Optional[Padded]:
        """The batch padded to its captured size in the static buffers, or None to run eagerly."""
        if (
            (batch.kv_indices is not None) != self.kv_rows
            or (batch.logits_indices is not None) != (self.per_request_logits)
            or (features is None) != (self.feature_dim is None)
        ):
            self._tell("shape", f"{self.label}: a batch unlike the captured ones runs eagerly")
            return None
        if self.per_request_logits and len(batch.logits_indices) != batch.batch_size:
            self._tell(
                "logits", f"{self.label}: a batch without one logits row per request runs eagerly"
            )
            return None
        size = size or self.padded_size(self.num_requests(batch))
        if size is None:
            return None
        if self.extend:
            if max(batch.extend_seq_lens_cpu) > self.width:
                self._tell(
                    "wide",
                    f"{self.label}: a request with more than {self.width} tokens runs eagerly",
                )
                return None
            return self._pad_extend(batch, features, size)
        return self._pad_decode(batch, features, size)

    def _pad_decode(
        self, batch: ForwardBatch, features: Optional[torch.Tensor], size: int
    ) -> Padded:
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
                raise RuntimeError(
                    f"{self.label}: a row attends to {width} keys, more than the {kv_idx.shape[1]} "
                    "the graphs were captured for; this is a bug, run with --disable-cuda-graph"
                )
            kv_idx[:n, :width], kv_idx[:n, width:] = batch.kv_indices, DUMMY_SLOT
            kv_ok[:n, :width], kv_ok[:n, width:] = batch.kv_mask, False
            kv_idx[n:] = DUMMY_SLOT
            kv_ok[n:] = False
            kv_ok[n:, 0] = True
            kv_idx, kv_ok = (
                kv_idx[:, :width],
                kv_ok[:, :width],
            )  # the metadata refill reads the batch's own width
        padded = replace(
            batch,
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            req_pool_indices=rpi,
            seq_lens=lens,
            seq_lens_cpu=list(batch.seq_lens_cpu) + [SEQ_LEN_FILL] * (rows - n),
            kv_indices=kv_idx,
            kv_mask=kv_ok,
        )
        token_rows = torch.arange(n, device=self.device)
        return self._finish(batch, padded, features, token_rows, size)

    def _pad_extend(
        self, batch: ForwardBatch, features: Optional[torch.Tensor], size: int
    ) -> Padded:
        b, w, rows = batch.batch_size, self.width, size * self.width
        q_lens, prefixes = batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu
        seq_lens_cpu = [p + w for p in prefixes] + [w] * (size - b)
        token_rows, seq_lens = upload(
            self.device,
            ([i * w + j for i, q in enumerate(q_lens) for j in range(q)], torch.int64),
            (seq_lens_cpu, torch.int64),
        )
        ids, pos, loc = self.input_ids[:rows], self.positions[:rows], self.out_cache_loc[:rows]
        for buf, src in (
            (ids, batch.input_ids),
            (pos, batch.positions),
            (loc, batch.out_cache_loc),
        ):
            buf.zero_()  # DUMMY_SLOT and position 0 for every padded row
            buf.index_copy_(0, token_rows, src)
        rpi, lens = self.req_pool_indices[:size], self.seq_lens[:size]
        rpi[:b], rpi[b:] = batch.req_pool_indices, self.dummy_row
        lens.copy_(seq_lens)
        masks = padded_masks(q_lens, prefixes, w, size, batch.custom_masks, self.device)
        padded = replace(
            batch,
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            req_pool_indices=rpi,
            seq_lens=lens,
            seq_lens_cpu=seq_lens_cpu,
            extend_seq_lens_cpu=[w] * size,
            extend_prefix_lens_cpu=list(prefixes) + [0] * (size - b),
            custom_masks=masks,
        )
        return self._finish(batch, padded, features, token_rows, size)

    def _finish(
        self,
        batch: ForwardBatch,
        padded: ForwardBatch,
        features: Optional[torch.Tensor],
        token_rows: torch.Tensor,
        size: int,
    ) -> Padded:
        out_rows = token_rows
        if self.per_request_logits:
            b = batch.batch_size
            logits = self.logits_indices[:size]
            logits[:b] = token_rows.index_select(0, batch.logits_indices)
            logits[b:] = (
                torch.arange(b, size, device=self.device) * self.width
            )  # a padded request's first row
            padded.logits_indices = logits
            out_rows = torch.arange(b, device=self.device)
        padded_features = None
        if features is not None:
            padded_features = self.features[: size * self.width]
            padded_features.zero_()
            padded_features.index_copy_(0, token_rows, features.to(padded_features.dtype))
        return Padded(padded, padded_features, size, token_rows, out_rows)

    def _tell(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            logger.info(message)


def build_graph_runners(
    args: Any,
    max_running_requests: int,
    dummy_row: int,
    device: torch.device,
    dtype: torch.dtype,
    specs: Sequence[GraphSpec],
) -> list[GraphRunner]:
    """One GraphRunner per spec, all on the capture list from `args`."""
    sizes = capture_sizes(args.cuda_graph_bs, args.cuda_graph_max_bs, max_running_requests)
    return [
        GraphRunner(spec, sizes, not args.disable_cuda_graph_padding, dummy_row, device, dtype)
        for spec in specs
    ]
