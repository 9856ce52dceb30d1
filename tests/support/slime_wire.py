"""slime's weight-update wire format, for tests (sglang is not installed): SGLang's
FlattenedTensorMetadata class under its real module name, and a flattened bucket serialised as
slime's MultiprocessingSerializer does."""

from __future__ import annotations

import base64
import dataclasses
import io
import sys
import types
from multiprocessing.reduction import ForkingPickler

import torch


def install_fake_sglang(monkeypatch) -> type:
    """sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata under its real name (for
    the calling test only), so the pickle names the class exactly as slime's does."""
    names = [
        "sglang",
        "sglang.srt",
        "sglang.srt.weight_sync",
        "sglang.srt.weight_sync.tensor_bucket",
    ]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = names[-1]
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    sys.modules[names[-1]].FlattenedTensorMetadata = FlattenedTensorMetadata
    return FlattenedTensorMetadata


def slime_payload(
    named: dict[str, torch.Tensor], meta_cls: type, byte_offsets: bool = True
) -> tuple[str, torch.Tensor]:
    """One rank's entry as slime sends it: MultiprocessingSerializer.serialize({"flattened_tensor",
    "metadata"}, output_str=True). byte_offsets: SGLang's multi-dtype FlattenedTensorBucket (a
    uint8 tensor, byte ranges); else the older one-dtype bucket (element ranges). Also the
    flattened tensor: the sender keeps it alive while the engine reads its shared memory."""
    chunks, metadata, offset = [], [], 0
    for name, tensor in named.items():
        flat = tensor.contiguous().flatten()
        flat = flat.view(torch.uint8) if byte_offsets else flat
        end = offset + flat.numel()
        metadata.append(meta_cls(name, tensor.shape, tensor.dtype, offset, end, flat.numel()))
        chunks.append(flat)
        offset = end
    flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump({"flattened_tensor": flat, "metadata": metadata})
    return base64.b64encode(buffer.getvalue()).decode(), flat
