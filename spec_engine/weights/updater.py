"""WeightUpdater: new weights into a running engine — target and draft, from tensors, a
torch.distributed broadcast, or disk — plus checksums and memory release/resume of weights.

Names are Hugging Face names. The target's go to the target; MTP layers (MiMo's
`model.mtp_layers.*`, GLM-4.5's next-n `model.layers.{N}.*`) go to the MTP draft; an external
draft (EAGLE, EAGLE-3, STANDALONE) is addressed with a `draft.` prefix on its own checkpoint
names (e.g. `draft.fc.weight`), or with `component="draft"` on disk updates. EAGLE-2 and MTP
drafts use the target's embedding and head tensors themselves, so a target update reaches them;
derived copies (CPU-packed weights, the FR-Spec head, EAGLE-3's id map) are rebuilt after every
update. An FP8 engine (weights/fp8.py) quantizes the target's and MTP layers' quantized linears
as they arrive unquantized, and dequantizes FP8 weights sent with their `*_scale_inv` scales.
Every tensor of a request is checked (known name, shape, dtype) before any is copied: a
bad request leaves all weights as they were.
"""

from __future__ import annotations

import datetime
import difflib
import logging
from collections.abc import Callable, Iterable
from typing import Optional, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from spec_engine.distributed.parallel_state import SINGLE, TPGroup
from spec_engine.weights import fp8
from spec_engine.weights.loader import (
    check_finite,
    check_one_value_per_slot,
    check_weights,
    checkpoint_metadata,
    copy_weights,
    fp8_block,
    hf_tensor,
    is_ignored,
    iterate_checkpoint,
    refresh_derived,
    tensor_checksum,
    weight_spec,
)
from spec_engine.weights.shard import Shard, assemble
from spec_engine.weights.transport import as_wire, materialize, parse_dtype, parse_shape

logger = logging.getLogger(__name__)
T = TypeVar("T")

DRAFT_PREFIX = "draft."
GROUP_TIMEOUT = datetime.timedelta(minutes=30)
# Joining waits for the trainer's side this long; generation is paused meanwhile, so it is short.
GROUP_CONNECT_TIMEOUT = datetime.timedelta(seconds=120)


class DraftWeights(Protocol):
    """What the updater needs of a draft (the draft runner)."""

    model: nn.Module
    external: bool  # a checkpoint of its own, addressed with DRAFT_PREFIX (not an MTP draft)

    def check_update(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def refresh(self) -> None: ...


class WeightUpdater:
    """Updates of the target model (on `device`) and of the draft, if there is one."""

    def __init__(
        self,
        target: nn.Module,
        device: torch.device,
        draft: Optional[DraftWeights] = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        """`tp`: the tensor-parallel group the target is a shard of (disk updates check on
        every rank before any rank copies)."""
        self.target = target
        self.device = device
        self.draft = draft
        self.tp = tp
        self.groups: dict[str, dist.ProcessGroup] = {}
        self._backup: Optional[list[tuple[nn.Parameter, torch.Tensor]]] = None

    # ---------------------------------------------------------------- routing

    def _route(self, name: str) -> tuple[Optional[nn.Module], str]:
        """(the model a Hugging Face name updates, or None if no model uses it; name in that
        model)."""
        draft = self.draft
        if name.startswith(DRAFT_PREFIX):
            if draft is None or not draft.external:
                raise ValueError(
                    f"weight {name!r}: the engine has no external draft model to update"
                )
            return draft.model, name[len(DRAFT_PREFIX) :]
        slot = weight_spec(self.target).get(name)
        if slot is None:
            raise ValueError(
                f"unknown weight {name!r} for {self.target.config.architecture}"
                f" (address an external draft's tensors as '{DRAFT_PREFIX}<name>')"
            )
        if slot.param is not None:
            return self.target, name
        if draft is not None and not draft.external and name in weight_spec(draft.model):
            return draft.model, name
        return None, name  # an MTP layer no draft step uses

    def _fp8_block(self, model: nn.Module) -> Optional[tuple[int, int]]:
        """The FP8 block updates of `model` are quantized in: the target's and its MTP layers';
        an external draft's updates are taken as sent (the trainer sends it unquantized)."""
        draft = self.draft
        if draft is not None and draft.external and model is draft.model:
            return None
        return fp8_block(model)

    def apply(self, named_tensors: Iterable[tuple[str, object]]) -> int:
        """Check every tensor, then copy all of them (a tensor-parallel rank its blocks, once
        every rank's checks passed); returns the bytes received."""
        groups, received = self.on_every_rank(lambda: self._check_tensors(named_tensors))
        for model, items in groups.values():
            copy_weights(model, items)
        if self.draft is not None:
            self.draft.refresh()
        return received

    def _check_tensors(
        self, named_tensors: Iterable[tuple[str, object]]
    ) -> tuple[dict[int, tuple[nn.Module, list[tuple[str, torch.Tensor]]]], int]:
        """The tensors of an update by the model they update, all checked (an FP8 engine's
        quantized as it serves them); and their bytes. Names, whole shapes and dtypes are checked
        first; then a tensor-parallel rank takes its block of each split tensor (an FP8 weight's
        with the same block of its scale grid, as loading reads them) and (de)quantizes that
        block alone: blocks hold whole FP8 blocks, so the values are those of the whole."""
        received = 0
        pairs = []
        for name, value in named_tensors:
            if not isinstance(name, str):
                raise ValueError(f"weight names must be strings, got {name!r}")
            tensor = materialize(value)
            received += tensor.numel() * tensor.element_size()
            pairs.append((name, tensor))
        block = fp8_block(self.target)
        meta = fp8.update_metadata(((n, tuple(t.shape), str(t.dtype)) for n, t in pairs), block)
        shapes = {name: tuple(tensor.shape) for name, tensor in pairs}
        routes: dict[str, tuple[nn.Module, str]] = {}
        for name, _, _ in meta:
            if not is_ignored(name):
                model, local = self._route(name)
                if model is not None:  # not another rank's experts or an MTP layer no draft uses
                    routes[name] = (model, local)
        models = {id(model): model for model, _ in routes.values()}
        for model in models.values():
            mine = [m for m in meta if m[0] in routes and routes[m[0]][0] is model]
            check_weights(model, ((routes[n][1], shape, dtype) for n, shape, dtype in mine))
        shards = {n: weight_spec(m)[local].shard for n, (m, local) in routes.items()}
        shards = {n: s for n, s in shards.items() if s is not None}
        cuts = fp8.with_scale_shards(shards, shapes, block) if block is not None else shards
        pairs = [
            (n, cuts[n].take(t) if n in cuts else t)
            for n, t in pairs
            if (fp8.weight_name(n) if fp8.is_scale_name(n) else n) in routes
        ]
        pairs, exact = fp8.dequantized_update(pairs, block)
        groups: dict[int, tuple[nn.Module, list[tuple[str, torch.Tensor]]]] = {}
        for name, tensor in pairs:
            model, local = routes[name]
            # An FP8 engine quantizes what arrives unquantized (what arrived in FP8 is exact).
            model_block = self._fp8_block(model)
            if model_block is not None and name not in exact:
                tensor = fp8.served(local, tensor, model_block)
            groups.setdefault(id(model), (model, []))[1].append((local, tensor))
        for model, items in groups.values():
            check_one_value_per_slot(model, items)
            for name, tensor in items:
                check_finite(name, tensor)
        if self.draft is not None:
            draft_items = groups.get(id(self.draft.model), (None, []))[1]
            self.draft.check_update(dict(draft_items))
        return groups, received

    # ---------------------------------------------------------------- disk

    def from_disk(self, model_path: str, component: str = "target") -> int:
        """Load a whole Hugging Face checkpoint into the target (its MTP layers into an MTP
        draft) or, with component="draft", into the external draft. A tensor-parallel rank
        reads its blocks alone (at --ep-size > 1 its own experts alone), and copies only once
        every rank has checked its part; returns the bytes this rank read."""
        routes, models, shards = self.on_every_rank(lambda: self._check_disk(model_path, component))
        received = 0
        quantize = fp8.read_block_fp8(model_path) is None  # an FP8 checkpoint's values are exact
        for name, tensor in iterate_checkpoint(model_path, _held(routes), shards):
            model, local = routes[name]
            block = self._fp8_block(model)
            if block is not None and quantize:
                tensor = fp8.served(local, tensor, block)
            copy_weights(model, [(local, tensor)], refresh=False)  # one pass, one refresh
            received += tensor.numel() * tensor.element_size()
        for model in models.values():
            refresh_derived(model)
        if self.draft is not None:
            self.draft.refresh()
        return received

    def _check_disk(
        self, model_path: str, component: str
    ) -> tuple[dict[str, tuple[Optional[nn.Module], str]], dict[int, nn.Module], dict[str, Shard]]:
        """Check a checkpoint before a disk update: (each name's model and name there, the
        models updated, this rank's blocks of the split tensors)."""
        meta = [m for m in checkpoint_metadata(model_path) if not is_ignored(m[0])]
        if component == "draft":
            if self.draft is None or not self.draft.external:
                raise ValueError("component='draft': the engine has no external draft model")
            models = {id(self.draft.model): self.draft.model}
            routes = {name: (self.draft.model, name) for name, _, _ in meta}
        elif component == "target":
            routes = {name: self._route(name) for name, _, _ in meta}
            models = {id(m): m for m, _ in routes.values() if m is not None}
            models.setdefault(id(self.target), self.target)
        else:
            raise ValueError(f"component must be 'target' or 'draft', got {component!r}")
        for model in models.values():
            check_weights(
                model,
                [(routes[n][1], s, d) for n, s, d in meta if routes[n][0] is model],
                require_all=True,
            )
        shards = {
            name: weight_spec(model)[local].shard
            for name, (model, local) in routes.items()
            if model is not None and weight_spec(model)[local].shard is not None
        }
        # A pass over the files before the first copy: a NaN found half-way would leave the
        # model half-updated.
        for name, tensor in iterate_checkpoint(model_path, _held(routes), shards):
            check_finite(name, tensor)
        return routes, models, shards

    def on_every_rank(self, check: Callable[[], T], done: str = "updated") -> T:
        """`check()` on this rank; under tensor parallelism every rank learns whether any
        rank's check failed, and all of them raise it (naming that rank), so none copies
        (`done`: what the error says no rank did)."""
        if self.tp.size == 1:
            return check()
        try:
            result, error = check(), None
        except Exception as e:  # every rank must reach the gather below
            result, error = None, str(e)
        for rank, failed in enumerate(self.tp.gather_objects(error)):
            if failed is not None:
                raise ValueError(f"{failed} (tensor-parallel rank {rank}; no rank {done})")
        return result

    # ---------------------------------------------------------------- distributed

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
    ) -> None:
        """Join the trainer's broadcast group (the trainer is rank 0) as rank `rank_offset` +
        this engine rank (SGLang's and slime's numbering: an engine of N ranks takes N places
        from `rank_offset`). Every rank of the engine calls this; unless all of them joined,
        all of them raise."""
        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} exists already")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend 'nccl' needs CUDA; use backend 'gloo' on CPU")
        last = world_size - self.tp.size
        if not 0 < rank_offset <= last:
            raise ValueError(
                f"rank_offset must be in 1..{last} (the trainer is rank 0, and this engine's "
                f"{self.tp.size} rank(s) take ranks rank_offset..rank_offset+{self.tp.size - 1} "
                f"of world_size {world_size}), got {rank_offset}"
            )
        rank = rank_offset + self.tp.rank

        def join() -> dist.ProcessGroup:
            store = dist.PrefixStore(
                group_name,
                dist.TCPStore(
                    master_address,
                    master_port,
                    world_size,
                    is_master=False,
                    timeout=GROUP_CONNECT_TIMEOUT,
                ),
            )
            if backend == "gloo":
                return dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)
            return dist.ProcessGroupNCCL(store, rank, world_size)

        self.groups[group_name] = self.on_every_rank(join, "kept the group")

    def destroy_group(self, group_name: str) -> None:
        """Leave a weight update group (SGLang's destroy_weights_update_group)."""
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(
                f"no weight update group {group_name!r}; joined: {sorted(self.groups) or 'none'}"
            )
        if hasattr(group, "shutdown"):
            group.shutdown()

    def from_distributed(
        self, names: list[str], dtypes: list, shapes: list, group_name: str
    ) -> int:
        """Receive one broadcast per tensor from rank 0 of the group, then apply them.

        Everything announced is received even if it will be refused, so the trainer's
        broadcasts never hang; the check happens before anything is copied. Under tensor
        parallelism every rank receives the whole tensors (each is a member of the group) and
        the ranks agree after each stage, so a rank that failed alone leaves no other waiting
        in a collective.
        """
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(
                f"no weight update group {group_name!r}; call init_weights_update_group first"
            )
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) differ "
                "in length"
            )
        device = (
            self.device
            if isinstance(group, getattr(dist, "ProcessGroupNCCL", ()))
            else torch.device("cpu")
        )
        # Every buffer is made before the first broadcast: failing half-way would leave the
        # trainer's remaining broadcasts to be taken by the next update.
        buffers = self.on_every_rank(
            lambda: [
                (
                    name,
                    torch.empty(parse_shape(name, shape), dtype=parse_dtype(dtype), device=device),
                )
                for name, dtype, shape in zip(names, dtypes, shapes)
            ],
            "received anything",
        )

        def receive() -> list[tuple[str, torch.Tensor]]:
            for _, tensor in buffers:
                group.broadcast(as_wire(tensor), 0).wait()
            return buffers

        return self.apply(self.on_every_rank(receive))

    # ---------------------------------------------------------------- checksums and memory

    def checksums(self, names: Optional[list[str]] = None) -> dict[str, str]:
        """SHA-256 per tensor, in the engine's dtype, of the target and draft (see
        tensor_checksum); under tensor parallelism of the whole tensors, gathered (every rank
        calls this)."""
        if names is not None and (
            not isinstance(names, list) or not all(isinstance(n, str) for n in names)
        ):
            raise ValueError(f"names must be a list of weight names, got {names!r}")
        every = self._named_weights()
        known = self._holders(every)
        wanted = list(known) if names is None else names
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise ValueError(f"no weights named {unknown[:5]}")
        return {n: tensor_checksum(t) for n, t in self._whole(wanted, every, known).items()}

    def names(self) -> list[str]:
        """Every weight's Hugging Face name (`draft.`-prefixed for an external draft), whichever
        rank holds it (at --ep-size > 1 every rank calls this)."""
        return list(self._holders(self._named_weights()))

    def tensor(self, name: str) -> torch.Tensor:
        """One weight by its Hugging Face name (`draft.`-prefixed for an external draft), whole:
        under tensor parallelism gathered from the ranks (every rank calls this)."""
        every = self._named_weights()
        known = self._holders(every)
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"no weight named {name!r}{hint}")
        return self._whole([name], every, known)[name]

    def _holders(self, every: dict[str, tuple[nn.Module, str]]) -> dict[str, list[int]]:
        """The ranks holding each weight (`every`: this rank's), in the target's order. At
        --ep-size > 1 a routed expert is held by its expert group's ranks alone (one rank at
        --ep-size equal to --tp-size), so the names are gathered; else every rank holds every
        name, as a block or whole."""
        if self.tp.ep_size == 1:
            return {n: list(range(self.tp.size)) for n in every}
        holders: dict[str, list[int]] = {}
        for rank, held in enumerate(self.tp.gather_objects(list(every))):
            for n in held:
                holders.setdefault(n, []).append(rank)
        order = {n: i for i, n in enumerate(weight_spec(self.target))}
        return {n: holders[n] for n in sorted(holders, key=lambda n: order.get(n, len(order)))}

    def _whole(
        self,
        names: list[str],
        every: dict[str, tuple[nn.Module, str]],
        holders: dict[str, list[int]],
    ) -> dict[str, torch.Tensor]:
        """The named tensors whole: a tensor-parallel rank's blocks of the split ones are
        gathered (one collective for all of them, host copies) from the ranks holding them and
        put where each rank's shard says, and a tensor that one rank alone holds (its experts at
        --ep-size equal to --tp-size) comes from that rank; the others are the same on every
        rank and this rank's."""
        held = {n: hf_tensor(*every[n]) for n in names if n in every}
        if self.tp.size == 1:
            return held
        slots = {n: weight_spec(every[n][0])[every[n][1]] for n in held}
        sent = [n for n in held if slots[n].shard is not None or len(holders[n]) < self.tp.size]
        ranks = self.tp.gather_objects(
            {n: (slots[n].shard, slots[n].shape, held[n].to("cpu", copy=True)) for n in sent}
        )
        # Replicated KV heads come from several ranks (the same values each time); an expert's
        # blocks from its expert group's ranks alone (--ep-size < --tp-size).
        parts = {n: [ranks[r][n] for r in holders[n] if n in ranks[r]] for n in names}
        return {n: assemble(parts[n]) if parts[n] else held[n] for n in names}

    def fill_weights(self, value: float) -> None:
        """Overwrite every floating-point weight with `value` (slime's weights_checker
        reset_tensors: what an update leaves untouched then shows)."""
        for model in self._models():
            for param in model.parameters():
                if param.is_floating_point():
                    param.data.fill_(value)
            refresh_derived(model)
        if self.draft is not None:
            self.draft.refresh()

    def _named_weights(self) -> dict[str, tuple[nn.Module, str]]:
        every = {}
        for name in weight_spec(self.target):
            model, local = self._route(name)
            if model is not None:
                every[name] = (model, local)
        if self.draft is not None and self.draft.external:
            for name, slot in weight_spec(self.draft.model).items():
                if slot.param is not None:
                    every[DRAFT_PREFIX + name] = (self.draft.model, name)
        return every

    def release_weights(self) -> None:
        """Move every weight out (to host memory on CUDA; kept aside on CPU), leaving empty
        tensors."""
        if self._backup is not None:
            return
        backup = []
        for model in self._models():
            for param in model.parameters():
                keep = param.data if param.device.type == "cpu" else param.data.to("cpu")
                backup.append((param, keep))
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            refresh_derived(model)
        self._backup = backup

    def resume_weights(self) -> None:
        if self._backup is None:
            return
        for param, keep in self._backup:
            param.data = keep.to(self.device)
        self._backup = None
        for model in self._models():
            refresh_derived(model)
        if self.draft is not None:
            self.draft.refresh()

    def _models(self) -> list[nn.Module]:
        """Each model once (a self-draft's is the target)."""
        models = [self.target]
        if self.draft is not None and self.draft.model is not self.target:
            models.append(self.draft.model)
        return models


def _held(routes: dict[str, tuple[Optional[nn.Module], str]]) -> Callable[[str], bool]:
    """Whether a checkpoint name is read at all: not another rank's experts (--ep-size > 1) or
    an MTP layer no draft uses, which are checked by name and shape but never read."""
    return lambda name: name in routes and routes[name][0] is not None
