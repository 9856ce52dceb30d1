"""Push trainer weights (Hugging Face names) into rollout engines, in buckets, and verify them.

Three paths, as in slime: `tensor` (per-dtype flattened buckets passed as tensors through the
engine's call; colocated, shared as CUDA IPC or shared-memory handles, one entry per engine rank:
see `ColocatedPlan`), `distributed` (disaggregated: the trainer is rank 0 of a group
with every engine and broadcasts each tensor) and `disk` (a Hugging Face checkpoint the engines
load). Into FP8 engines (--quantization fp8) the `tensor` and `distributed` paths send the
quantized linears in FP8 with their block scales, as slime does; `disk` writes them unquantized
and the engine quantizes them. The target's and the MTP layers' tensors travel together (MTP
names route to the draft in the engine). Engines are anything with `spec_engine.Engine`'s update
methods: an in-process Engine, or a Ray actor wrapper with the same names.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from spec_engine.distributed.parallel_state import TPGroup
from spec_engine.dtypes import DTYPES
from spec_engine.weights import fp8
from spec_engine.weights.fp8 import is_scale_name
from spec_engine.weights.loader import tensor_checksum
from spec_engine.weights.transport import FlattenedBucket, as_wire, serialize_shared
from spec_engine.weights.updater import DRAFT_PREFIX
from trainer_bridge.megatron_compat import free_port

logger = logging.getLogger(__name__)

SYNC_MODES = ("tensor", "distributed", "disk")
GROUP_NAME = "specrl_weight_sync"
BROADCAST_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class WeightSyncConfig:
    update_weight_buffer_size: int = field(
        default=512 * 2**20,
        metadata={
            "help": "Bytes of weights per bucket pushed into the engines (slime's default: 512 "
            "MiB)."
        },
    )
    weight_sync_mode: str = field(
        default="tensor",
        metadata={
            "help": "tensor (colocated: flattened buckets through the engine call), distributed (a "
            "broadcast group with "
            "the engines) or disk (save a Hugging Face checkpoint the engines load).",
            "choices": SYNC_MODES,
        },
    )
    check_weight_update_equal: bool = field(
        default=False,
        metadata={
            "help": "After every push, compare each engine's per-tensor checksums with what was "
            "sent; fail on a difference."
        },
    )
    weight_sync_dir: Optional[str] = field(
        default=None,
        metadata={
            "help": "Directory for --weight-sync-mode disk checkpoints (default: "
            "<output-dir>/weight_sync)."
        },
    )

    def __post_init__(self) -> None:
        if self.weight_sync_mode not in SYNC_MODES:
            raise ValueError(
                f"--weight-sync-mode must be one of {', '.join(SYNC_MODES)}; got "
                f"{self.weight_sync_mode!r}"
            )
        if self.update_weight_buffer_size <= 0:
            raise ValueError(
                "--update-weight-buffer-size must be positive, got "
                f"{self.update_weight_buffer_size}"
            )


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most `max_bytes` (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        # An FP8 weight's block scales travel in its bucket: the engine dequantizes them together.
        if bucket and size + nbytes > max_bytes and not is_scale_name(name):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """(item, whether it is the last): each item once the next is known."""
    pending, has = None, False
    for item in items:
        if has:
            yield pending, False
        pending, has = item, True
    if has:
        yield pending, True


def outgoing(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    block: Optional[tuple[int, int]],
    sent: Optional[dict[str, torch.Tensor]] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors as they travel: into FP8 engines (`block`) each quantized linear of the
    target and its MTP layers as float8_e4m3fn with its float32 `weight_scale_inv`, as slime
    sends them (half of BF16's bytes); the rest as given. `sent`, if given, keeps what was
    given, for --check-weight-update-equal."""
    for name, tensor in named_tensors:
        tensor = tensor.detach()
        if sent is not None:
            sent[name] = tensor.cpu()
        # An external draft (`draft.` names) stays unquantized.
        if (
            block is not None
            and fp8.quantized_weight(name, tensor)
            and not name.startswith(DRAFT_PREFIX)
        ):
            weight, scale = fp8.quantize(tensor, block)
            yield name, weight
            yield fp8.scale_name(name), scale
        else:
            yield name, tensor


@dataclass(frozen=True)
class ColocatedPlan:
    """A colocated push from a trainer of several ranks, slime's way (update_weight_from_tensor's
    _send_to_colocated_engine): the engines' ranks sit on the trainer's devices in order (engine
    i's `sizes[i]` ranks on trainer ranks offset_i = sum(sizes[:i]) onwards), and each trainer
    rank shares its own copy of every bucket (on its own device: the IPC handle is of that
    device), so entry j of engine i's `serialized_named_tensors` comes from trainer rank
    offset_i + j, which shares a device with engine rank j. An engine whose ranks reach past the
    trainer's (fewer trainer ranks than engine ranks) gets rank 0's copy in every entry instead,
    as a trainer of one rank sends. Decided on rank 0 (`block`: the FP8 block the engines serve
    in) and sent to the other ranks."""

    block: Optional[tuple[int, int]]
    sizes: tuple[int, ...]
    world: int  # the trainer's ranks

    def offsets(self) -> list[int]:
        return [sum(self.sizes[:i]) for i in range(len(self.sizes))]

    def per_rank(self, engine: int) -> bool:
        """Whether engine `engine`'s entries come from its own trainer ranks."""
        return self.offsets()[engine] + self.sizes[engine] <= self.world

    def shares(self, rank: int) -> bool:
        """Whether trainer rank `rank` serializes an entry (of the engine on its device)."""
        return any(
            o <= rank < o + size and self.per_rank(i)
            for i, (o, size) in enumerate(zip(self.offsets(), self.sizes))
        )

    def entries(self, gathered: Sequence[Optional[str]]) -> list[list[str]]:
        """Each engine's serialized_named_tensors of one bucket, from every trainer rank's
        serialized copy (`gathered`, by rank; rank 0's always there)."""
        return [
            list(gathered[o : o + size]) if self.per_rank(i) else [gathered[0]] * size
            for i, (o, size) in enumerate(zip(self.offsets(), self.sizes))
        ]


def share_colocated(
    named_tensors: Iterable[tuple[str, torch.Tensor]], cfg: WeightSyncConfig, trainer: TPGroup
) -> None:
    """Trainer rank `trainer.rank` (not 0) of a colocated `tensor` push that rank 0's
    WeightPusher(trainer=...) makes: the same tensors (every rank's whole, as the export gathers
    give them), bucketed alike; each bucket serialized here (if the plan uses this rank's) and
    gathered to rank 0, and kept alive until rank 0 reports the engines' copies done."""
    plan = trainer.gather_objects(None)[0]
    if not isinstance(plan, ColocatedPlan):
        raise RuntimeError(f"trainer rank 0 could not start the colocated push: {plan}")
    mine = plan.shares(trainer.rank)
    chunks = buckets(outgoing(named_tensors, plan.block), cfg.update_weight_buffer_size)
    for bucket, _ in with_last(chunks):
        payload = [b.to_dict() for b in FlattenedBucket.pack(bucket)]
        trainer.gather_objects(serialize_shared(payload) if mine else None)
        failed = trainer.gather_objects(None)[0]  # rank 0's: the engines are done with it
        del payload
        if mine and torch.cuda.is_available():
            torch.cuda.ipc_collect()
        if failed is not None:
            raise RuntimeError(f"the colocated push failed on trainer rank 0: {failed}")


class WeightPusher:
    """Sends one weight version to every engine; keeps the broadcast group between pushes."""

    def __init__(
        self,
        engines: Sequence[Any],
        cfg: WeightSyncConfig,
        output_dir: Optional[str] = None,
        colocated: bool = False,
        trainer: Optional[TPGroup] = None,
    ) -> None:
        """`colocated`: the engines run on this machine and device (--colocate), so tensor-mode
        buckets are shared with them (CUDA IPC, shared memory on CPU) rather than copied.
        `trainer`: a colocated push from a trainer of several ranks, this pusher its rank 0 (a
        gloo group of them; the others call share_colocated in step): each engine rank gets the
        copy of the trainer rank on its device (ColocatedPlan)."""
        self.engines = [RayEngine(e) if _is_ray_actor(e) else e for e in engines]
        self.cfg = cfg
        self.colocated = colocated
        several = trainer is not None and trainer.size > 1 and cfg.weight_sync_mode == "tensor"
        self.trainer = trainer if colocated and several else None
        self.disk_dir = cfg.weight_sync_dir or os.path.join(output_dir or ".", "weight_sync")
        self._group: Optional[dist.ProcessGroup] = None
        # One group per pusher: engines keep a joined group's name, so a new pusher needs a new one.
        self.group_name = f"{GROUP_NAME}_{uuid.uuid4().hex[:8]}"
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines)) + 1)
        self._last_disk_version: Optional[str] = None
        self._block: Optional[tuple[Optional[tuple[int, int]]]] = None  # asked once, see _fp8_block
        self._sizes: Optional[list[int]] = None  # asked once, see _tp_sizes
        self._plan: Optional[ColocatedPlan] = None  # this push's, with `trainer`

    def push(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str
    ) -> dict[str, float]:
        """Push every tensor, then (optionally) verify; returns bytes, seconds and bucket count."""
        start = time.perf_counter()
        sent: dict[str, torch.Tensor] = {}
        count, nbytes = 0, 0
        mode = self.cfg.weight_sync_mode
        if mode == "disk":
            tensors = {n: t.detach().contiguous().cpu() for n, t in named_tensors}
            sent, count = tensors, 1
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            self._push_disk(tensors, version)
        else:
            block = self._plan_colocated() if self.trainer is not None else self._fp8_block()
            keep = sent if self.cfg.check_weight_update_equal else None
            chunks = buckets(
                outgoing(named_tensors, block, keep), self.cfg.update_weight_buffer_size
            )
            # Each bucket goes out once the next is known, so the last one carries the version.
            for bucket, last in with_last(chunks):
                self._push_bucket(bucket, version if last else None)
                count += 1
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            if count == 0:
                raise ValueError("no weights to push")
        if self.cfg.check_weight_update_equal:
            self.verify(sent)
        seconds = time.perf_counter() - start
        return {"bytes": float(nbytes), "seconds": seconds, "buckets": float(count)}

    def _plan_colocated(self) -> Optional[tuple[int, int]]:
        """Decide the colocated push's plan and send it to the other trainer ranks (an error
        instead, so that none waits for buckets that will not come); returns the FP8 block."""
        try:
            plan = ColocatedPlan(self._fp8_block(), tuple(self._tp_sizes()), self.trainer.size)
        except Exception as e:
            self.trainer.gather_objects(repr(e))
            raise
        self.trainer.gather_objects(plan)
        self._plan = plan
        return plan.block

    def _fp8_block(self) -> Optional[tuple[int, int]]:
        """The FP8 block every engine serves its weights in (None: unquantized engines, or
        engines that differ, which then quantize what they get themselves)."""
        if self._block is None:
            blocks = {
                tuple(b) if b else None
                for b in (e.get_server_info().get("weight_block_size") for e in self.engines)
            }
            self._block = (blocks.pop() if len(blocks) == 1 else None,)
        return self._block[0]

    def verify(self, sent: dict[str, torch.Tensor]) -> None:
        """Every engine's checksum of every sent tensor must equal the sent tensor's, in the
        engine's dtype (for an FP8 engine: its quantized linears quantized, as the engine holds
        them); raise naming the engine and tensors otherwise."""
        for i, engine in enumerate(self.engines):
            info = engine.get_server_info()
            dtype = DTYPES[info["dtype"]]
            block = tuple(info["weight_block_size"]) if info.get("weight_block_size") else None
            # Every tensor the engine uses; ones it takes but never uses (MTP layers past the
            # draft's, or all of them without speculation) have no checksum to compare.
            got = engine.get_weights_checksum()
            used = [n for n in sent if n in got]
            if not used:
                raise RuntimeError(
                    f"--check-weight-update-equal: engine {i} uses none of the {len(sent)} tensors "
                    "sent"
                )
            held = {n: _as_held(n, sent[n], dtype, block) for n in used}
            bad = [n for n in used if got[n] != tensor_checksum(held[n])]
            if bad:
                raise RuntimeError(
                    f"--check-weight-update-equal: engine {i} holds different values for "
                    f"{len(bad)} of "
                    f"{len(used)} tensors after the update (first: {bad[:3]}); the update did not "
                    "land"
                )

    def _push_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: Optional[str]) -> None:
        last = version is not None
        if self.cfg.weight_sync_mode == "tensor":
            payload = [b.to_dict() for b in FlattenedBucket.pack(bucket)]
            per_engine: list[dict[str, Any]] = [{"named_tensors": payload}] * len(self.engines)
            if self.colocated:
                # Each engine rank opens the bucket in place (SGLang's one entry per rank): the
                # copy of the trainer rank on its device (ColocatedPlan), or this process's copy
                # in every entry (a trainer of one rank); the call returns once every rank copied.
                shared = serialize_shared(payload)
                entries = [[shared] * size for size in self._tp_sizes()]
                if self.trainer is not None:
                    entries = self._plan.entries(self.trainer.gather_objects(shared))
                per_engine = [{"serialized_named_tensors": e} for e in entries]
            failed: Optional[BaseException] = None
            try:
                calls = [
                    self._pool.submit(
                        e.update_weights_from_tensor,
                        load_format="flattened_bucket",
                        flush_cache=last,
                        weight_version=version,
                        **tensors,
                    )
                    for e, tensors in zip(self.engines, per_engine)
                ]
                for call in calls:
                    call.result()
            except BaseException as e:  # the other trainer ranks learn of it below
                failed = e
            if self.trainer is not None:  # the others may free their copies (or raise) now
                self.trainer.gather_objects(None if failed is None else repr(failed))
            if failed is not None:
                raise failed
            if self.colocated and torch.cuda.is_available():
                torch.cuda.ipc_collect()  # free the IPC-shared blocks the engines released
            return
        group = self._broadcast_group()
        names = [n for n, _ in bucket]
        dtypes = [str(t.dtype).replace("torch.", "") for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        # The engines wait for the broadcasts, so their calls start first and finish after them.
        calls = [
            self._pool.submit(
                e.update_weights_from_distributed,
                names,
                dtypes,
                shapes,
                self.group_name,
                flush_cache=last,
                weight_version=version,
            )
            for e in self.engines
        ]
        for _, tensor in bucket:
            group.broadcast(as_wire(tensor.contiguous()), 0).wait()
        for call in calls:
            call.result()

    def _push_disk(self, tensors: dict[str, torch.Tensor], version: str) -> None:
        path = os.path.join(self.disk_dir, version)
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        self._on_all("update_weights_from_disk", model_path=path, weight_version=version)
        # Only the version the engines hold is kept: one checkpoint per step would fill the disk.
        if self._last_disk_version not in (None, version):
            shutil.rmtree(os.path.join(self.disk_dir, self._last_disk_version), ignore_errors=True)
        self._last_disk_version = version

    def _broadcast_group(self) -> dist.ProcessGroup:
        if self._group is None:
            # MASTER_ADDR: this trainer's address as the engines see it (Ray sets it per node).
            address, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), free_port()
            # slime's numbering: engine i's N ranks take N places after those of engines < i.
            sizes = self._tp_sizes()
            offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
            world = 1 + sum(sizes)
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            name = self.group_name
            store = dist.PrefixStore(
                name,
                dist.TCPStore(
                    address,
                    port,
                    world,
                    is_master=True,
                    timeout=BROADCAST_TIMEOUT,
                    wait_for_workers=False,
                ),
            )
            joins = [
                self._pool.submit(
                    e.init_weights_update_group, address, port, offset, world, name, backend
                )
                for e, offset in zip(self.engines, offsets)
            ]
            make = self._pool.submit(
                lambda: (
                    dist.ProcessGroupNCCL(store, 0, world)
                    if backend == "nccl"
                    else dist.ProcessGroupGloo(store, 0, world, BROADCAST_TIMEOUT)
                )
            )
            # An engine that fails to join would leave the rendezvous waiting for it: report its
            # error at once.
            done, _ = wait(joins + [make], return_when=FIRST_EXCEPTION)
            for future in done:
                if future.exception() is not None:
                    raise RuntimeError(
                        f"an engine could not join the weight-sync group {name!r}"
                    ) from future.exception()
            self._group = make.result()
            for join in joins:
                join.result()
        return self._group

    def _tp_sizes(self) -> list[int]:
        """Each engine's tensor-parallel ranks (its server info's tp_size)."""
        if self._sizes is None:
            self._sizes = [e.get_server_info().get("tp_size", 1) for e in self.engines]
        return self._sizes

    def _on_all(self, method: str, **kwargs: Any) -> None:
        for call in [self._pool.submit(getattr(e, method), **kwargs) for e in self.engines]:
            call.result()

    def close(self) -> None:
        self._group = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def _as_held(
    name: str, tensor: torch.Tensor, dtype: torch.dtype, block: Optional[tuple[int, int]]
) -> torch.Tensor:
    """A sent tensor as an engine of `dtype` (FP8 with `block`) holds it."""
    if not tensor.is_floating_point():
        return tensor  # integer tensors (an EAGLE-3 draft's d2t) keep their dtype
    if block is not None and not name.startswith(DRAFT_PREFIX):
        tensor = fp8.served(name, tensor, block)
    return tensor.to(dtype)


class RayEngine:
    """Blocking calls on an engine Ray actor (rollout.engine_actor.EngineActor), so the pusher
    treats it like an in-process Engine."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __getattr__(self, name: str) -> Any:
        import ray

        method = getattr(self.actor, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))


def _is_ray_actor(engine: Any) -> bool:
    return hasattr(getattr(engine, "update_weights_from_tensor", None), "remote")
