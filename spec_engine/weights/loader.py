"""Weights: read Hugging Face safetensors checkpoints and copy named tensors into a model.

A model describes the Hugging Face names it takes with `hf_weight_spec()`: for each name the
parameter it lands in, the row range inside a fused parameter, and the expected shape. Loading
from disk and updates from a trainer both check every tensor (`check_weights`) before copying
any (`copy_weights`), so a bad request leaves the model unchanged.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import pickle
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
from safetensors import safe_open
from torch import nn

# Names some checkpoints carry that are derived, not learned; skipped without error.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_ignored(name: str) -> bool:
    """Buffers some checkpoints carry that every model recomputes (rotary inverse frequencies)."""
    return name.endswith(_IGNORED_SUFFIXES)
# safetensors dtype names (and torch's, upper-cased) that weights may have.
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "FLOAT64", "FLOAT32", "FLOAT16", "BFLOAT16", "FLOAT", "HALF", "DOUBLE"}


@dataclass(frozen=True)
class WeightSlot:
    param: Optional[str]                      # parameter name in the model; None: accepted, not used here
    shape: tuple[int, ...]                    # expected Hugging Face tensor shape
    rows: Optional[tuple[int, int]] = None    # row range inside a fused parameter
    optional: bool = False                    # may be absent from a checkpoint (tied head)
    integer: bool = False                     # an index table (EAGLE-3's d2t), not a float weight


def weight_spec(model: nn.Module) -> dict[str, WeightSlot]:
    """The model's hf_weight_spec(), built once (it depends on the config only)."""
    spec = model.__dict__.get("_hf_weight_spec")
    if spec is None:
        spec = model.__dict__["_hf_weight_spec"] = model.hf_weight_spec()
    return spec


def named_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every parameter by name, tied names included, built once (the Parameter objects stay;
    release/resume and updates change only their data)."""
    params = model.__dict__.get("_named_params")
    if params is None:
        params = model.__dict__["_named_params"] = dict(model.named_parameters(remove_duplicate=False))
    return params


def safetensors_files(model_path: str) -> list[str]:
    """The checkpoint's safetensors files: from the shard index when there is one."""
    if not isinstance(model_path, str) or not os.path.isdir(model_path):
        raise ValueError(f"model path {model_path!r} is not a directory; give a Hugging Face checkpoint directory")
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not found:
        raise ValueError(f"no *.safetensors files in {model_path!r}; specrl loads safetensors checkpoints only")
    return [os.path.join(model_path, f) for f in found]


def iterate_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def safetensors_metadata(model_path: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every tensor in the checkpoint, without reading the data."""
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                yield name, tuple(sl.get_shape()), sl.get_dtype()


def load_checkpoint(model: nn.Module, model_path: str, only_known: bool = False) -> None:
    """Load a Hugging Face safetensors checkpoint (checked before anything is copied).

    With `only_known`, tensors the model does not name are skipped: a module that lives inside
    a larger checkpoint (MiMo's MTP draft) takes just its own.
    """
    spec = weight_spec(model)
    keep = (lambda name: name in spec) if only_known else (lambda name: True)
    check_weights(model, (m for m in safetensors_metadata(model_path) if keep(m[0])), require_all=True)
    copy_weights(model, ((n, t) for n, t in iterate_safetensors(model_path) if keep(n)))


def check_weights(model: nn.Module, metadata: Iterable[tuple[str, tuple[int, ...], str]],
                  require_all: bool = False) -> None:
    """Raise ValueError naming the first tensor the model cannot take (name, shape or dtype).

    With `require_all`, every non-optional name of the model's spec must be present.
    """
    spec = weight_spec(model)
    seen = set()
    for name, shape, dtype in metadata:
        if is_ignored(name):
            continue
        slot = spec.get(name)
        if slot is None:
            raise ValueError(f"unknown weight {name!r} for {type(model).__name__}")
        if tuple(shape) != slot.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(shape)}, expected {slot.shape}")
        is_float = str(dtype).replace("torch.", "").upper() in _FLOAT_DTYPES
        if is_float == slot.integer:
            kind = "an integer" if slot.integer else "a floating-point"
            raise ValueError(f"weight {name!r} has dtype {dtype}, expected {kind} tensor")
        seen.add(name)
    if require_all:
        missing = sorted(n for n, s in spec.items() if not s.optional and n not in seen)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")


def copy_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], refresh: bool = True) -> list[str]:
    """Copy already-checked Hugging Face-named tensors into the model; returns the names.
    `refresh=False` leaves derived state to one refresh_derived call after several copies."""
    spec = weight_spec(model)
    params = named_params(model)
    loaded = []
    touched_storages = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            if is_ignored(name):
                continue
            slot = spec[name]
            if slot.param is None:
                continue
            target = params[slot.param]
            touched_storages.add(target.untyped_storage().data_ptr())
            if slot.rows is not None:
                target = target[slot.rows[0]:slot.rows[1]]
            target.copy_(tensor)
            loaded.append(name)
    if refresh:
        refresh_derived(model, touched_storages)
    return loaded


def refresh_derived(model: nn.Module, storages: Optional[set[int]] = None) -> None:
    """Rebuild derived copies (packed weights, sliced heads) of modules whose parameters live
    in the given storages (all when None). Storage, not name, decides: a tied embedding
    written under its own name changes the LM head too."""
    for module in model.modules():
        refresh = getattr(module, "refresh_derived", None)
        if refresh is None:
            continue
        if storages is None or any(p.untyped_storage().data_ptr() in storages for p in module.parameters(recurse=False)):
            refresh()


def hf_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The model's current value of a Hugging Face-named tensor (a view, in the model's dtype)."""
    slot = weight_spec(model)[name]
    param = named_params(model)[slot.param]
    return param.detach() if slot.rows is None else param.detach()[slot.rows[0]:slot.rows[1]]


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (contiguous, little-endian, its own dtype): compare with the
    checksum of what was sent, cast to the engine's dtype."""
    data = tensor.detach().contiguous().cpu()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class FlatMeta:
    name: str
    shape: tuple[int, ...]
    start: int   # element range in the bucket's flat tensor
    end: int


@dataclass
class FlattenedBucket:
    """Many tensors of one dtype sent as one flat tensor plus (name, shape, range) metadata:
    one large transfer instead of many small ones (SGLang's "flattened_bucket" load format)."""

    flat: torch.Tensor
    metadata: list[FlatMeta]

    @classmethod
    def pack(cls, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list["FlattenedBucket"]:
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
    def from_dict(cls, data: dict) -> "FlattenedBucket":
        """From {"flattened_tensor": tensor, "metadata": [{name, shape, start_idx, end_idx}, ...]}."""
        try:
            flat = data["flattened_tensor"]
            metadata = [FlatMeta(str(m["name"]), tuple(int(d) for d in m["shape"]), int(m["start_idx"]), int(m["end_idx"]))
                        for m in data["metadata"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a flattened bucket needs 'flattened_tensor' and 'metadata' entries with name, shape, "
                             f"start_idx, end_idx ({e!r})") from None
        bad = next((m for m in metadata if any(d < 0 for d in m.shape) or not 0 <= m.start <= m.end), None)
        if bad is not None:
            raise ValueError(f"flattened bucket entry {bad.name!r} has shape {bad.shape} and range "
                             f"[{bad.start}, {bad.end}); dimensions and ranges must be non-negative")
        return cls(flat, metadata)

    def to_dict(self) -> dict:
        return {"flattened_tensor": self.flat,
                "metadata": [{"name": m.name, "shape": list(m.shape), "start_idx": m.start, "end_idx": m.end}
                             for m in self.metadata]}

    def unpack(self) -> list[tuple[str, torch.Tensor]]:
        """Views into the flat tensor; a range past its end or not matching the shape is refused."""
        if not isinstance(self.flat, torch.Tensor) or self.flat.dim() != 1:
            raise ValueError("a flattened bucket's tensor must be 1-D")
        out = []
        for m in self.metadata:
            numel = 1
            for d in m.shape:
                numel *= d
            if m.end - m.start != numel or m.start < 0:
                raise ValueError(f"bucket entry {m.name!r}: range [{m.start}, {m.end}) does not hold shape {m.shape}")
            if m.end > self.flat.numel():
                raise ValueError(f"bucket entry {m.name!r} ends at {m.end} but the bucket holds {self.flat.numel()} "
                                 "elements (truncated bucket)")
            out.append((m.name, self.flat[m.start:m.end].view(m.shape)))
        return out


def materialize(value) -> torch.Tensor:
    """A tensor, or one shared by another process: the (rebuild function, args) pair that
    torch.multiprocessing.reductions.reduce_tensor makes (CUDA IPC handles, CPU shared memory)."""
    tensor = value
    if isinstance(value, tuple) and len(value) == 2 and callable(value[0]):
        tensor = value[0](*value[1])
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a tensor (or a reduce_tensor handle), got {type(value).__name__}")
    if tensor.is_meta or tensor.layout != torch.strided or tensor.is_quantized:
        # Checked here, before anything is copied: such a tensor would fail half-way through.
        raise ValueError(f"expected a dense tensor with data, got a {'meta' if tensor.is_meta else tensor.layout} tensor")
    return tensor


def serialize_tensors(payload) -> str:
    """Tensors (a list of (name, tensor), or bucket dicts) as base64 text for HTTP."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_tensors(text: str):
    """The inverse of serialize_tensors; loads tensors and plain containers only (weights_only)."""
    try:
        return torch.load(io.BytesIO(base64.b64decode(text, validate=True)), map_location="cpu", weights_only=True)
    except (ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"serialized_named_tensors could not be decoded ({e}); send serialize_tensors' output") from None
