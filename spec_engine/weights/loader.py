"""Loading weights: read Hugging Face checkpoints (safetensors or pytorch_model.bin; block-FP8
ones dequantized as they are read, weights/fp8.py) and copy named tensors into a model (an FP8
engine's quantized linears fake-quantized when the checkpoint holds them unquantized).

A model describes the Hugging Face names it takes with `hf_weight_spec()`: for each name the
parameter it lands in, the row range inside a fused parameter, and the expected shape. Loading
from disk and updates from a trainer both check every tensor (`check_weights`) before copying
any (`copy_weights`), so a bad request leaves the model unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from spec_engine.weights import fp8
from spec_engine.weights.shard import Shard

# Names some checkpoints carry that are derived, not learned; skipped without error.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_ignored(name: str) -> bool:
    """Buffers some checkpoints carry that every model recomputes (rotary inverse frequencies)."""
    return name.endswith(_IGNORED_SUFFIXES)


# safetensors dtype names (and torch's, upper-cased) that weights may have.
_FLOAT_DTYPES = {
    "F64",
    "F32",
    "F16",
    "BF16",
    "FLOAT64",
    "FLOAT32",
    "FLOAT16",
    "BFLOAT16",
    "FLOAT",
    "HALF",
    "DOUBLE",
}


@dataclass(frozen=True)
class WeightSlot:
    param: Optional[str]  # parameter name in the model; None: accepted, not used here
    shape: tuple[int, ...]  # expected Hugging Face tensor shape
    rows: Optional[tuple[int, int]] = None  # row range inside a fused parameter
    optional: bool = False  # may be absent from a checkpoint (tied head)
    integer: bool = False  # an index table (EAGLE-3's d2t), not a float weight
    # Tensor parallelism: the block of the checkpoint tensor this rank copies into `rows`
    # (weights.shard); None: all of it.
    shard: Optional[Shard] = None


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
        params = model.__dict__["_named_params"] = dict(
            model.named_parameters(remove_duplicate=False)
        )
    return params


def checkpoint_files(model_path: str) -> list[str]:
    """The checkpoint's weight files: safetensors, else pytorch_model*.bin (published EAGLE
    drafts), from the shard index when there is one. Only regular files inside `model_path` are
    read: an index entry pointing elsewhere, or a FIFO or directory under a weight file's name,
    is an error naming it."""
    if not isinstance(model_path, str) or not os.path.isdir(model_path):
        raise ValueError(
            f"model path {model_path!r} is not a directory; give a Hugging Face checkpoint "
            "directory"
        )
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = os.path.join(model_path, index_name)
        if os.path.isfile(index):
            return [_weight_file(model_path, s, index) for s in _index_shards(index)]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if os.path.lexists(os.path.join(model_path, single)):
            return [_weight_file(model_path, single)]
    names = sorted(os.listdir(model_path))
    found = [f for f in names if f.endswith(".safetensors")] or [
        f for f in names if f.startswith("pytorch_model") and f.endswith(".bin")
    ]
    if not found:
        raise ValueError(
            f"no *.safetensors or pytorch_model*.bin files in {model_path!r}; give a Hugging "
            "Face checkpoint directory"
        )
    return [_weight_file(model_path, f) for f in found]


def _index_shards(index: str) -> list[str]:
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{index!r} is not a shard index (a JSON object with a 'weight_map' of tensor name to "
            f"file name): {e}"
        ) from None
    if not all(isinstance(name, str) for name in shards):
        raise ValueError(f"{index!r} maps tensors to non-string file names")
    return shards


def _weight_file(model_path: str, name: str, index: Optional[str] = None) -> str:
    """`model_path/name`, refused unless `name` is a plain file name inside the directory and the
    file is a regular file (a FIFO would block the reader forever)."""
    source = f" (listed in {index!r})" if index else ""
    if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] in ("..", ""):
        raise ValueError(
            f"weight file {name!r}{source} is outside the checkpoint directory {model_path!r}"
        )
    path = os.path.join(model_path, name)
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ValueError(f"weight file {path!r}{source} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"weight file {path!r}{source} is not a regular file")
    return path


def _read_bin(path: str) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin state dict: tensors only (weights_only), memory-mapped when the file
    is in torch's zip format."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several kinds for a damaged or foreign file
        raise ValueError(f"could not read the weights file {path!r}: {e}") from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(f"{path!r} is not a state dict of named tensors")
    return state


@contextlib.contextmanager
def _open_safetensors(path: str) -> Iterator[Any]:
    """safe_open, with a damaged file (truncated, not safetensors) reported as a ValueError
    naming it."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"could not read the weights file {path!r}: {e}") from None


def iterate_checkpoint(
    model_path: str,
    only: Optional[Callable[[str], bool]] = None,
    shards: Optional[dict[str, Shard]] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the checkpoint (those whose names `only` accepts: the
    others are not read), as models take them: a block-FP8 checkpoint's weights dequantized to
    float32 and its scales left out (weights/fp8.py); a name in `shards` (a tensor-parallel
    rank's blocks) read as that block alone (a safetensors slice; a memory-mapped .bin's tensor
    narrowed), so an FP8 weight is dequantized, or quantized by --quantization fp8, as the
    rank's block alone."""
    fmt = fp8.read_block_fp8(model_path)
    if fmt is None:
        for name, tensor in _stored_tensors(model_path, only, shards):
            fp8.refuse_unquantized_fp8(name, str(tensor.dtype))
            yield name, tensor
        return

    def wanted_scale(name: str) -> bool:
        return fp8.is_scale_name(name) and (only is None or only(fp8.weight_name(name)))

    # A rank's block of an FP8 weight is scaled by the same block of its scale grid (SGLang's
    # block-FP8 loader reads both so), read as a slice too.
    cuts = {}
    if shards:
        shapes = {name: shape for name, shape, _ in _stored_metadata(model_path)}
        cuts = fp8.with_scale_shards(shards, shapes, fmt.block)
    scales = dict(_stored_tensors(model_path, wanted_scale, cuts))

    def wanted(name: str) -> bool:  # the scales are read above, once
        return not fp8.is_scale_name(name) and (only is None or only(name))

    yield from fp8.dequantized_tensors(_stored_tensors(model_path, wanted, shards), scales, fmt)


def _stored_tensors(
    model_path: str,
    only: Optional[Callable[[str], bool]] = None,
    shards: Optional[dict[str, Shard]] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as stored (those whose names `only` accepts; those in `shards`
    as the rank's block)."""
    shards = shards or {}
    for path in checkpoint_files(model_path):
        if path.endswith(".bin"):  # memory-mapped: a block narrowed is all that is read
            for name, tensor in _read_bin(path).items():
                if only is None or only(name):
                    yield name, shards[name].take(tensor) if name in shards else tensor
            continue
        with _open_safetensors(path) as f:
            for name in f.keys():
                if only is not None and not only(name):
                    continue
                shard = shards.get(name)
                if shard is None:
                    yield name, f.get_tensor(name)
                else:
                    yield name, shard.read(f.get_slice(name))


def checkpoint_metadata(
    model_path: str, as_stored: bool = False
) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every tensor in the checkpoint (safetensors: without reading the
    data), as `iterate_checkpoint` yields them: a block-FP8 checkpoint's weights as F32, their
    scales checked and left out; `as_stored`: every tensor as the files hold it."""
    stored = _stored_metadata(model_path)
    if as_stored:
        yield from stored
        return
    fmt = fp8.read_block_fp8(model_path)
    if fmt is not None:
        yield from fp8.dequantized_metadata(stored, fmt)
        return
    for name, shape, dtype in stored:
        fp8.refuse_unquantized_fp8(name, dtype)
        yield name, shape, dtype


def _stored_metadata(model_path: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    for path in checkpoint_files(model_path):
        if path.endswith(".bin"):
            for name, t in _read_bin(path).items():
                yield name, tuple(t.shape), str(t.dtype).removeprefix("torch.").upper()
            continue
        with _open_safetensors(path) as f:
            for name in f.keys():
                sl = f.get_slice(name)
                yield name, tuple(sl.get_shape()), sl.get_dtype()


def build_model(
    model_cls: type[nn.Module],
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    checkpoint: str,
    only_known: bool = False,
    **model_kwargs: Any,
) -> nn.Module:
    """Instantiate and load a model: built on the meta device and allocated once on the target
    device, so no time goes to a random initialisation that loading overwrites."""
    with torch.device("meta"):
        model = model_cls(config, **model_kwargs)
    model = model.to(dtype).to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    load_checkpoint(model, checkpoint, only_known=only_known)
    return model.eval().requires_grad_(False)


def load_checkpoint(model: nn.Module, model_path: str, only_known: bool = False) -> None:
    """Load a Hugging Face checkpoint (checked before anything is copied).

    With `only_known`, tensors the model does not name are skipped: a module that lives inside
    a larger checkpoint (MiMo's MTP draft) takes just its own.
    """
    spec = weight_spec(model)
    block = fp8_block(model)
    if block is not None:
        check_fp8_partitions(model, block)
    keep = (lambda name: name in spec) if only_known else (lambda name: True)
    check_weights(
        model, (m for m in checkpoint_metadata(model_path) if keep(m[0])), require_all=True
    )
    shards = {n: s.shard for n, s in spec.items() if s.shard is not None}
    # Tensors the model accepts and does not hold (another rank's experts at --ep-size > 1, MTP
    # layers the trunk skips) are checked above and not read.
    skipped = {n for n, s in spec.items() if s.param is None}
    tensors = iterate_checkpoint(model_path, lambda n: keep(n) and n not in skipped, shards)
    if block is not None and fp8.read_block_fp8(model_path) is None:
        tensors = fp8.fake_quantized(tensors, block)  # --quantization fp8 on a BF16 checkpoint
    copy_weights(model, tensors)


def fp8_block(model: nn.Module) -> Optional[tuple[int, int]]:
    """The FP8 block a model serves its quantized linears in (None: unquantized)."""
    return getattr(getattr(model, "config", None), "weight_block_size", None)


def check_fp8_partitions(model: nn.Module, block: tuple[int, int]) -> None:
    """Refuse a tensor-parallel split that cuts the FP8 blocks of a quantized linear the model
    holds a block of (fp8.scale_shard): each rank reads its FP8 weights with their scales,
    quantizes at load and takes updates in whole blocks."""
    for name, slot in weight_spec(model).items():
        if slot.shard is not None and slot.param is not None and len(slot.shape) == 2:
            if fp8.is_quantized_linear(name):
                fp8.scale_shard(name, slot.shard, slot.shape, block)


def check_weights(
    model: nn.Module,
    metadata: Iterable[tuple[str, tuple[int, ...], str]],
    require_all: bool = False,
) -> None:
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


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Refuse an update's tensor with NaN or Inf values (before anything is copied)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ValueError(
            f"weight {name!r} has non-finite values (NaN or Inf); nothing was updated — check "
            "the trainer's weights before pushing them"
        )


def check_one_value_per_slot(model: nn.Module, items: list[tuple[str, torch.Tensor]]) -> None:
    """Two names landing in one place (a tied embedding and head) must carry equal values."""
    spec = weight_spec(model)
    params = named_params(model)
    seen: dict[tuple, tuple[str, torch.Tensor]] = {}
    for name, tensor in items:
        slot = spec[name]
        if slot.param is None:
            continue
        key = (params[slot.param].untyped_storage().data_ptr(), slot.rows)
        if key in seen and not torch.equal(seen[key][1].to(tensor.dtype), tensor):
            raise ValueError(
                f"weights {seen[key][0]!r} and {name!r} are one tensor in this model (tied) but "
                "were "
                "sent with different values; send one of them"
            )
        seen[key] = (name, tensor)


def copy_weights(
    model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], refresh: bool = True
) -> list[str]:
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
            if slot.shard is not None:
                tensor = slot.shard.take(tensor)
            if slot.rows is not None:
                target = target[slot.rows[0] : slot.rows[1]]
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
        if storages is None or any(
            p.untyped_storage().data_ptr() in storages for p in module.parameters(recurse=False)
        ):
            refresh()


def hf_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The model's current value of a Hugging Face-named tensor (a view, in the model's dtype)."""
    slot = weight_spec(model)[name]
    param = named_params(model)[slot.param]
    return param.detach() if slot.rows is None else param.detach()[slot.rows[0] : slot.rows[1]]


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (contiguous, little-endian, its own dtype): compare with the
    checksum of what was sent, cast to the engine's dtype."""
    data = tensor.detach().contiguous().cpu()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()
