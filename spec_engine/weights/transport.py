"""Moving weights between processes: flattened buckets (one transfer per dtype), tensors shared
by another process (CUDA IPC / shared-memory handles), base64 text for HTTP, and the tensors
of a torch.distributed broadcast (announced by dtype and shape names; FP8 moved as bytes).

update_weights_from_tensor's serialized_named_tensors entries are read in two forms:
SGLang's MultiprocessingSerializer (base64 of a ForkingPickler pickle: tensors shared, not
copied) through a restricted unpickler (deserialize_shared), and serialize_tensors' torch.save
text. A flattened bucket ({"flattened_tensor", "metadata"}) comes in either of SGLang's
layouts, told apart by the flat tensor's dtype: uint8 with byte ranges and a dtype per entry
(FlattenedTensorBucket with supports_multi_dtypes, what slime sends now), or the entries' own
dtype with element ranges (older SGLang, one dtype per bucket)."""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class FlatMeta:
    name: str
    shape: tuple[int, ...]
    start: int  # element range in the bucket's flat tensor (bytes in a uint8 bucket of `dtype`)
    end: int
    dtype: Optional[torch.dtype] = None  # the tensor's own dtype, when the bucket mixes dtypes


@dataclass
class SGLangTensorMetadata:
    """What slime's pickles name sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata:
    read without SGLang installed. Offsets are bytes into a uint8 bucket that mixes dtypes
    (SGLang >= its multi-dtype buckets), or elements of a one-dtype bucket before that."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class FlattenedBucket:
    """Many tensors of one dtype sent as one flat tensor plus (name, shape, range) metadata:
    one large transfer instead of many small ones (SGLang's "flattened_bucket" load format)."""

    flat: torch.Tensor
    metadata: list[FlatMeta]

    @classmethod
    def pack(cls, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[FlattenedBucket]:
        """One bucket per dtype."""
        groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in named_tensors:
            groups.setdefault(tensor.dtype, []).append((name, tensor))
        buckets = []
        for items in groups.values():
            metadata, start = [], 0
            for name, tensor in items:
                metadata.append(FlatMeta(name, tuple(tensor.shape), start, start + tensor.numel()))
                start += tensor.numel()
            buckets.append(cls(torch.cat([t.reshape(-1) for _, t in items]), metadata))
        return buckets

    @classmethod
    def from_dict(cls, data: dict) -> FlattenedBucket:
        """From {"flattened_tensor": tensor, "metadata": [{name, shape, start_idx, end_idx},
        ...]}, or SGLang's form with FlattenedTensorMetadata entries (what slime sends)."""
        try:
            flat = data["flattened_tensor"]
            metadata = [
                FlatMeta(m.name, tuple(int(d) for d in m.shape), m.start_idx, m.end_idx, m.dtype)
                if isinstance(m, SGLangTensorMetadata)
                else FlatMeta(
                    str(m["name"]),
                    tuple(int(d) for d in m["shape"]),
                    int(m["start_idx"]),
                    int(m["end_idx"]),
                    _dtype(m.get("dtype")),
                )
                for m in data["metadata"]
            ]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(
                "a flattened bucket needs 'flattened_tensor' and 'metadata' entries with name, "
                f"shape, start_idx, end_idx ({e!r})"
            ) from None
        bad = next(
            (m for m in metadata if any(d < 0 for d in m.shape) or not 0 <= m.start <= m.end), None
        )
        if bad is not None:
            raise ValueError(
                f"flattened bucket entry {bad.name!r} has shape {bad.shape} and range "
                f"[{bad.start}, {bad.end}); dimensions and ranges must be non-negative"
            )
        return cls(flat, metadata)

    def to_dict(self) -> dict:
        """The bucket as plain data. An FP8 bucket travels as its bytes (uint8, each entry
        naming its dtype): torch cannot unpickle float8 tensors pickled plainly (as Ray does)."""
        flat, dtype = self.flat, None
        if flat.is_floating_point() and flat.element_size() == 1:
            flat, dtype = flat.view(torch.uint8), str(flat.dtype).removeprefix("torch.")
        return {
            "flattened_tensor": flat,
            "metadata": [
                {"name": m.name, "shape": list(m.shape), "start_idx": m.start, "end_idx": m.end}
                | ({"dtype": dtype} if dtype else {})
                for m in self.metadata
            ],
        }

    def unpack(self) -> list[tuple[str, torch.Tensor]]:
        """Views into the flat tensor; a range past its end or not matching the shape is refused."""
        if not isinstance(self.flat, torch.Tensor) or self.flat.dim() != 1:
            raise ValueError("a flattened bucket's tensor must be 1-D")
        out = []
        for m in self.metadata:
            numel = 1
            for d in m.shape:
                numel *= d
            # A uint8 bucket of other dtypes holds bytes (SGLang's multi-dtype layout).
            as_bytes = self.flat.dtype == torch.uint8 and m.dtype not in (None, torch.uint8)
            if as_bytes:
                numel *= torch.empty((), dtype=m.dtype).element_size()
            if m.end - m.start != numel or m.start < 0:
                raise ValueError(
                    f"bucket entry {m.name!r}: range [{m.start}, {m.end}) does not hold shape "
                    f"{m.shape}"
                )
            if m.end > self.flat.numel():
                raise ValueError(
                    f"bucket entry {m.name!r} ends at {m.end} but the bucket holds "
                    f"{self.flat.numel()} "
                    "elements (truncated bucket)"
                )
            flat = self.flat[m.start : m.end]
            if as_bytes:
                flat = flat.view(m.dtype)
            elif m.dtype is not None and m.dtype != self.flat.dtype:
                raise ValueError(
                    f"bucket entry {m.name!r} is {m.dtype} but the bucket holds {self.flat.dtype}"
                )
            out.append((m.name, flat.view(m.shape)))
        return out


def _dtype(name: Any) -> Optional[torch.dtype]:
    """A bucket entry's dtype by torch's name ("float8_e4m3fn"); None when not given."""
    if name is None:
        return None
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"bucket entry dtype {name!r} is not a torch dtype name")
    return dtype


def materialize(value) -> torch.Tensor:
    """A tensor, or one shared by another process: the (rebuild function, args) pair that
    torch.multiprocessing.reductions.reduce_tensor makes (CUDA IPC handles, CPU shared memory)."""
    tensor = value
    if isinstance(value, tuple) and len(value) == 2 and callable(value[0]):
        tensor = value[0](*value[1])
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(
            f"expected a tensor (or a reduce_tensor handle), got {type(value).__name__}"
        )
    if tensor.is_meta or tensor.layout != torch.strided or tensor.is_quantized:
        # Checked here, before anything is copied: such a tensor would fail half-way through.
        raise ValueError(
            "expected a dense tensor with data, got a "
            f"{'meta' if tensor.is_meta else tensor.layout} tensor"
        )
    return tensor


def serialize_tensors(payload) -> str:
    """Tensors (a list of (name, tensor), or bucket dicts) as base64 text for HTTP."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_tensors(text: str):
    """The inverse of serialize_tensors; loads tensors and plain containers only (weights_only)."""
    try:
        return torch.load(
            io.BytesIO(base64.b64decode(text, validate=True)), map_location="cpu", weights_only=True
        )
    except (ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(
            f"serialized_named_tensors could not be decoded ({e}); send serialize_tensors' output"
        ) from None


def serialize_shared(payload: Any) -> str:
    """Tensors shared, not copied, for a receiver on this machine: CUDA tensors as CUDA IPC
    handles, CPU tensors in shared memory, pickled as torch.multiprocessing does and base64-encoded
    — SGLang's MultiprocessingSerializer format (`output_str=True`), what slime sends as
    `serialized_named_tensors`. The sender must keep the tensors alive until the receiver has
    copied them (a synchronous update call does)."""
    # The default file_descriptor strategy hands descriptors over a socket guarded by a key
    # that only child processes share: unrelated processes (Ray actors) need shared-memory names.
    torch.multiprocessing.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    _SharingPickler(buffer).dump(payload)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class _SharingPickler(ForkingPickler):
    """ForkingPickler that also lets this process open its own CUDA handles. torch's reduce_tensor
    caches an exported storage under its IPC handle, but rebuild_cuda_tensor looks it up under
    (handle, offset) (torch 2.11 to 2.13), so a receiver in the sender's own process misses the
    cache and calls cudaIpcOpenMemHandle on its own allocation, which CUDA refuses ("invalid
    device context", seen on an H200 with the engine in the trainer's process). The storage is
    cached under the key the rebuild uses as well."""

    def reducer_override(self, obj: Any) -> Any:
        if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
            return NotImplemented
        from torch.multiprocessing.reductions import (
            StorageWeakRef,
            reduce_tensor,
            shared_cache,
        )

        rebuild, args = reduce_tensor(obj)
        handle = args[_REDUCE_TENSOR_ARG_HANDLE_INDEX]
        offset = args[_REDUCE_TENSOR_ARG_OFFSET_INDEX]
        if handle is not None:
            shared_cache[(handle, offset)] = StorageWeakRef(obj._typed_storage())
        return rebuild, args


def deserialize_shared(data: str | bytes) -> Any:
    """The inverse of serialize_shared (also SGLang's bytes form). Only tensors, storages and
    plain containers are rebuilt: any other global in the pickle is refused, so a request cannot
    run code."""
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
        return _SharedTensorUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # whatever a malformed payload raises is the sender's error: a 400
        raise ValueError(
            f"serialized_named_tensors could not be decoded ({e}); send SGLang's "
            "MultiprocessingSerializer output (spec_engine.weights.transport.serialize_shared)"
        ) from None


_BUILTINS = frozenset(
    {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bool", "bytes", "slice"}
)


def _rebuild_cuda_tensor_from_uuid(*args: Any) -> torch.Tensor:
    """SGLang's patch_torch._rebuild_cuda_tensor_modified: CUDA IPC handles that name their
    device by UUID (slime and SGLang patch torch's reductions so), rebuilt on the local index of
    that device."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = args[_REDUCE_TENSOR_ARG_DEVICE_INDEX]
    if isinstance(device, str):
        local = [
            i
            for i in range(torch.cuda.device_count())
            if str(torch.cuda.get_device_properties(i).uuid) == device
        ]
        if not local:
            raise ValueError(
                f"the tensors live on GPU {device}, which this process cannot see; the engine and "
                "the sender must share a GPU for CUDA IPC (use update_weights_from_distributed "
                "across GPUs)"
            )
        args = (*args[:_REDUCE_TENSOR_ARG_DEVICE_INDEX], local[0], *args[7:])
    return rebuild_cuda_tensor(*args)


# Where torch's reduce_tensor puts the device in a CUDA tensor's rebuild arguments (SGLang's
# constant of the same name).
_REDUCE_TENSOR_ARG_DEVICE_INDEX = 6
# ... and the storage's IPC handle and its byte offset in the CUDA allocation.
_REDUCE_TENSOR_ARG_HANDLE_INDEX, _REDUCE_TENSOR_ARG_OFFSET_INDEX = 7, 9
# SGLang names in slime's pickles, and what stands for each here.
_SGLANG_GLOBALS = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): SGLangTensorMetadata,
    ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"): SGLangTensorMetadata,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): (
        _rebuild_cuda_tensor_from_uuid
    ),
}


class _SharedTensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SGLANG_GLOBALS:
            return _SGLANG_GLOBALS[module, name]
        if module == "multiprocessing.resource_sharer":
            raise pickle.UnpicklingError(
                f"refusing to unpickle {module}.{name}: the CPU tensors were shared by file "
                "descriptor, which only the sender's child processes can open; call "
                "torch.multiprocessing.set_sharing_strategy('file_system') in the sender (or "
                "send CUDA tensors)"
            )
        allowed = (
            (module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"))
            or (
                module == "torch"
                and (
                    name in ("Tensor", "Size", "device")
                    or isinstance(getattr(torch, name, None), torch.dtype)
                )
            )
            or (module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"))
            or (module == "torch.nn.parameter" and name == "Parameter")
            or (module == "builtins" and name in _BUILTINS)
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"refusing to unpickle {module}.{name}: only torch tensors and storages, torch "
                "dtypes and sizes, plain containers and SGLang's FlattenedTensorMetadata are "
                "allowed in serialized_named_tensors"
            )
        return super().find_class(module, name)


def as_wire(tensor: torch.Tensor) -> torch.Tensor:
    """What a broadcast moves of `tensor`: FP8 as its bytes (uint8, a view), since gloo has no
    FP8 type ("Invalid scalar type"); anything else as it is."""
    if tensor.is_floating_point() and tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    return tensor


def parse_shape(name: str, shape) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and d >= 0 for d in shape
    ):
        raise ValueError(
            f"weight {name!r}: shape must be a list of non-negative integers, got {shape!r}"
        )
    return tuple(shape)


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use a torch dtype name such as 'bfloat16'")
    return value
