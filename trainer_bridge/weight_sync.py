"""Push trainer weights (Hugging Face names) into rollout engines, in buckets, and verify them.

Three paths, as in slime: `tensor` (colocated: per-dtype flattened buckets passed as tensors
through the engine's call; the engine also accepts CUDA IPC handles, which this pusher does not
send yet), `distributed` (disaggregated: the trainer is rank 0 of a group
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


class WeightPusher:
    """Sends one weight version to every engine; keeps the broadcast group between pushes."""

    def __init__(
        self,
        engines: Sequence[Any],
        cfg: WeightSyncConfig,
        output_dir: Optional[str] = None,
        colocated: bool = False,
    ) -> None:
        """`colocated`: the engines run on this machine and device (--colocate), so tensor-mode
        buckets are shared with them (CUDA IPC, shared memory on CPU) rather than copied."""
        self.engines = [RayEngine(e) if _is_ray_actor(e) else e for e in engines]
        self.cfg = cfg
        self.colocated = colocated
        self.disk_dir = cfg.weight_sync_dir or os.path.join(output_dir or ".", "weight_sync")
        self._group: Optional[dist.ProcessGroup] = None
        # One group per pusher: engines keep a joined group's name, so a new pusher needs a new one.
        self.group_name = f"{GROUP_NAME}_{uuid.uuid4().hex[:8]}"
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines)) + 1)
        self._last_disk_version: Optional[str] = None
        self._block: Optional[tuple[Optional[tuple[int, int]]]] = None  # asked once, see _fp8_block
        self._sizes: Optional[list[int]] = None  # asked once, see _tp_sizes

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
            pending: Optional[list[tuple[str, torch.Tensor]]] = None
            block = self._fp8_block()
            outgoing = self._outgoing(named_tensors, block, sent)
            for bucket in buckets(outgoing, self.cfg.update_weight_buffer_size):
                # Each bucket goes out once the next is known, so the last one carries the version.
                if pending is not None:
                    self._push_bucket(pending, None)
                pending = bucket
                count += 1
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            if pending is None:
                raise ValueError("no weights to push")
            self._push_bucket(pending, version)
        if self.cfg.check_weight_update_equal:
            self.verify(sent)
        seconds = time.perf_counter() - start
        return {"bytes": float(nbytes), "seconds": seconds, "buckets": float(count)}

    def _outgoing(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        block: Optional[tuple[int, int]],
        sent: dict[str, torch.Tensor],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors as they travel: into FP8 engines (`block`) each quantized linear of the
        target and its MTP layers as float8_e4m3fn with its float32 `weight_scale_inv`, as slime
        sends them (half of BF16's bytes); the rest as given. `sent` keeps what was given, for
        --check-weight-update-equal."""
        for name, tensor in named_tensors:
            tensor = tensor.detach()
            if self.cfg.check_weight_update_equal:
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
                # Each engine rank opens the bucket in place (SGLang's one entry per rank: the
                # same one here, this process's copy); the call returns once every rank copied.
                shared = serialize_shared(payload)
                per_engine = [
                    {"serialized_named_tensors": [shared] * size} for size in self._tp_sizes()
                ]
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
