"""The forms a weight update's tensors arrive in, decoded into (name, tensor) pairs for
WeightUpdater.apply: a dict or a list of pairs, SGLang's flattened buckets (load_format
"flattened_bucket"), tensors shared by a process on this machine (serialized_named_tensors),
and over HTTP their text forms."""

from __future__ import annotations

from typing import Any, Optional, Union

from spec_engine.weights.transport import (
    FlattenedBucket,
    deserialize_shared,
    deserialize_tensors,
)

FLATTENED_BUCKET = "flattened_bucket"


def named_tensor_pairs(
    named_tensors: Any, load_format: Optional[str], shared: Union[str, bytes, None] = None
) -> list[tuple[str, Any]]:
    """The (name, tensor) pairs of update_weights_from_tensor's named_tensors, or of `shared`
    (one serialized_named_tensors entry: SGLang's MultiprocessingSerializer string, whose
    tensors are shared, not copied). Values may still be reduce_tensor handles
    (transport.materialize opens them)."""
    if shared is not None:
        named_tensors = deserialize_shared(shared)
    if load_format == FLATTENED_BUCKET:
        return _bucket_pairs(named_tensors)
    if isinstance(named_tensors, dict) and set(named_tensors) == {"flattened_tensor", "metadata"}:
        raise ValueError(
            "these tensors are a flattened bucket: send load_format 'flattened_bucket'"
        )
    if isinstance(named_tensors, dict):
        return list(named_tensors.items())
    if isinstance(named_tensors, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in named_tensors
    ):
        return list(named_tensors)
    raise ValueError("named_tensors must be a dict or a list of (name, tensor) pairs")


def _bucket_pairs(named_tensors: Any) -> list[tuple[str, Any]]:
    """FlattenedBucket objects or their to_dict() dicts (one per dtype), or one of them."""
    buckets = named_tensors if isinstance(named_tensors, list) else [named_tensors]
    if not all(isinstance(b, (FlattenedBucket, dict)) for b in buckets):
        raise ValueError(
            "load_format='flattened_bucket' takes FlattenedBucket objects or their to_dict() dicts"
        )
    return [
        pair
        for b in buckets
        for pair in (b if isinstance(b, FlattenedBucket) else FlattenedBucket.from_dict(b)).unpack()
    ]


def tensors_from_text(body: dict[str, Any]) -> dict[str, Any]:
    """An HTTP body's serialized_named_tensors as update_weights_from_tensor takes it: a list
    (SGLang's MultiprocessingSerializer strings, one per tensor-parallel rank: tensors shared
    with a process on this machine) stays; one string (transport.serialize_tensors: the
    tensors themselves) becomes named_tensors."""
    serialized = body.get("serialized_named_tensors")
    if isinstance(serialized, str):
        body["named_tensors"] = deserialize_tensors(body.pop("serialized_named_tensors"))
    elif not isinstance(serialized, list):
        raise ValueError(
            "serialized_named_tensors is required: a list of SGLang MultiprocessingSerializer "
            "strings, or one spec_engine.weights.transport.serialize_tensors string"
        )
    return body
