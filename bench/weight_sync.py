"""Weight update bandwidth of each engine path against a plain copy of the same bytes.

    python -m scripts.bench_weight_sync                 # random ~100M-parameter Llama, CPU
    python -m scripts.bench_weight_sync --preset llama-3.1-8b --device cuda --dtype bfloat16

Paths: update_weights_from_tensor with (name, tensor) pairs, with flattened per-dtype buckets,
with torch.multiprocessing reduce_tensor handles (shared memory on CPU, CUDA IPC on GPU); the
colocated push a trainer makes (`colocated_process`: the engine in another process on the same
device, each bucket shared with it in SGLang's serializer format, as --colocate does); a gloo
broadcast from a trainer rank (update_weights_from_distributed; on CPU), or an NCCL one into an
engine process on a second GPU (when there is one); a safetensors checkpoint
(update_weights_from_disk). Each time is the engine
call, best of --repeats, including the check of every tensor and the rebuild of derived copies
(on CPU the oneDNN-packed weights, also timed on their own). The ceiling is torch copy_ of one
flat buffer of the same size on the same device. For an 8B model the colocated push should take
under a second on an H100/H200.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from bench.checkpoints import PRESETS, apply_preset, cached, work_dir
from tiny.checkpoints import build_checkpoint
from trainer_bridge.megatron_compat import free_port

COLOCATED_TARGET_S = 1.0  # an 8B colocated push on one H100/H200 (issue [gpu-ready])


def best(fn, repeats: int, sync: bool = False) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_seconds(tensors: list[torch.Tensor], device: torch.device, repeats: int) -> float:
    """The ceiling: one copy_ of a flat buffer holding every weight, on the same device."""
    src = torch.cat([t.reshape(-1) for t in tensors])
    dst = torch.empty_like(src, device=device)
    return best(lambda: dst.copy_(src), repeats, sync=device.type == "cuda")


def engine_process(path: str, engine_kwargs: dict[str, Any], conn: Any) -> None:
    """The colocated engine: receives serialized buckets, applies them, answers the seconds."""
    from spec_engine import Engine

    with Engine(model_path=path, **engine_kwargs) as engine:
        conn.send("ready")
        while (message := conn.recv()) is not None:
            kind, *payload = message
            start = time.perf_counter()
            if kind == "shared":  # buckets in SGLang's serializer format
                for serialized in payload[0]:
                    engine.update_weights_from_tensor(
                        serialized_named_tensors=[serialized], load_format="flattened_bucket"
                    )
            elif kind == "join":  # the trainer's NCCL group, as rank 1
                engine.init_weights_update_group(*payload, 1, 2, "bench", "nccl")
            else:  # "broadcast": receive every tensor from rank 0
                engine.update_weights_from_distributed(*payload, "bench")
            conn.send(time.perf_counter() - start)


def start_engine(path: str, engine_kwargs: dict, env: dict[str, str]) -> tuple[Any, Any]:
    """An engine in a new process (with `env` set there), and the pipe to it."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # a spawned process starts with this process's environment
    try:
        proc = ctx.Process(target=engine_process, args=(path, engine_kwargs, child), daemon=True)
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if parent.recv() != "ready":
        raise RuntimeError("the engine process did not start")
    return proc, parent


def stop_engine(proc: Any, conn: Any) -> None:
    conn.send(None)
    proc.join(timeout=120)
    if proc.is_alive():
        proc.kill()


def nccl_push(path: str, engine_kwargs: dict, tensors: dict, repeats: int) -> float:
    """Best time of an NCCL broadcast of every tensor from this process (GPU 0, the trainer)
    into an engine on GPU 1, as --weight-sync-mode distributed does."""
    proc, conn = start_engine(path, engine_kwargs, {"CUDA_VISIBLE_DEVICES": "1"})
    try:
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
        group = dist.ProcessGroupNCCL(dist.PrefixStore("bench", store), 0, 2)
        conn.send(("join", "127.0.0.1", port))
        conn.recv()
        names = list(tensors)
        dtypes = [str(t.dtype) for t in tensors.values()]
        shapes = [list(t.shape) for t in tensors.values()]
        times = []
        for _ in range(repeats + 1):  # the first round sets the communicator up
            start = time.perf_counter()
            conn.send(("broadcast", names, dtypes, shapes))
            for t in tensors.values():
                group.broadcast(t, 0).wait()
            conn.recv()
            times.append(time.perf_counter() - start)
        return min(times[1:])
    finally:
        stop_engine(proc, conn)


def colocated_push(
    path: str, engine_kwargs: dict, named: list, bucket_bytes: int, repeats: int
) -> float:
    """Best wall time of a trainer-side push of every bucket into an engine in another process
    on the same device, each bucket shared (CUDA IPC / shared memory), as --colocate does."""
    from spec_engine.weights.transport import FlattenedBucket, serialize_shared
    from trainer_bridge.weight_sync import buckets

    proc, conn = start_engine(path, engine_kwargs, {})
    try:
        times = []
        for _ in range(repeats + 1):  # the first round warms up the IPC mappings
            start = time.perf_counter()
            payload = [
                serialize_shared([b.to_dict() for b in FlattenedBucket.pack(group)])
                for group in buckets(named, bucket_bytes)
            ]
            conn.send(("shared", payload))
            conn.recv()
            times.append(time.perf_counter() - start)
        return min(times[1:])
    finally:
        stop_engine(proc, conn)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    path = build_model(args)
    # The trainer's copy of the weights, on its device.
    tensors = {
        n: t.to(device) for n, t in load_file(os.path.join(path, "model.safetensors")).items()
    }
    results = {"memcpy": copy_seconds(list(tensors.values()), device, args.repeats)}
    engine_kwargs = dict(
        skip_tokenizer_init=True,
        random_seed=0,
        max_total_tokens=4096,
        device=args.device,
        dtype=args.dtype,
        skip_server_warmup=True,
    )
    results.update(in_process(path, engine_kwargs, tensors, args.repeats))
    results["colocated_process"] = colocated_push(
        path, engine_kwargs, list(tensors.items()), args.bucket_mib * 2**20, args.repeats
    )
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        results["distributed_nccl"] = nccl_push(path, engine_kwargs, tensors, args.repeats)
    report(results, tensors, args)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a real model's shape")
    parser.add_argument("--hidden-size", type=int, default=640)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--intermediate-size", type=int, help="default: 2.7 x hidden size")
    parser.add_argument("--num-heads", type=int, help="default: hidden size / 64")
    parser.add_argument("--num-kv-heads", type=int, help="default: hidden size / 128")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--bucket-mib", type=int, default=512, help="colocated push bucket size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--work-dir", help="keep the random checkpoint here, for later runs of the same shape"
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    apply_preset(args)
    return args


def build_model(args: argparse.Namespace) -> str:
    """The random Llama of the flags' shape (found again under --work-dir)."""
    root = work_dir(args.work_dir, "bench-weights-", args)
    return cached(
        os.path.join(root, "model"),
        lambda d: build_checkpoint(
            d,
            arch="llama",
            dtype=args.dtype,
            init_device=args.device,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size or int(args.hidden_size * 2.7),
            num_layers=args.num_layers,
            num_heads=args.num_heads or max(1, args.hidden_size // 64),
            num_kv_heads=args.num_kv_heads or max(1, args.hidden_size // 128),
            initializer_range=0.02,
        ),
    )


def in_process(
    path: str, engine_kwargs: dict, tensors: dict[str, torch.Tensor], repeats: int
) -> dict[str, float]:
    """Best seconds of each path into an engine in this process, by path name."""
    from torch.multiprocessing.reductions import reduce_tensor

    from spec_engine import Engine
    from spec_engine.weights.loader import refresh_derived
    from spec_engine.weights.transport import FlattenedBucket

    cuda = engine_kwargs["device"] == "cuda"
    named = list(tensors.items())
    results = {}
    engine = Engine(model_path=path, **engine_kwargs)
    try:
        engine.update_weights_from_tensor(named)  # warm-up: first-touch allocations
        results["tensor"] = best(lambda: engine.update_weights_from_tensor(named), repeats)
        buckets = [b.to_dict() for b in FlattenedBucket.pack(named)]
        results["flattened_bucket"] = best(
            lambda: engine.update_weights_from_tensor(buckets, load_format="flattened_bucket"),
            repeats,
        )
        if not cuda:
            # In-process shared memory. CUDA IPC handles open only in another process (on an
            # H200 this process's own failed with "invalid device context"): colocated_process
            # measures them.
            handles = [(n, reduce_tensor(t.share_memory_())) for n, t in named]
            results["ipc_handles"] = best(
                lambda: engine.update_weights_from_tensor(handles), repeats
            )
            results["distributed_gloo"] = gloo_update(engine, tensors, repeats)
        results["disk"] = best(lambda: engine.update_weights_from_disk(path), repeats)
        if not cuda:
            # Derived CPU copies alone (oneDNN-packed weights), included in every path above.
            results["cpu_repack_only"] = best(lambda: refresh_derived(engine.runner.model), repeats)
    finally:
        engine.shutdown()
    return results


def report(
    results: dict[str, float], tensors: dict[str, torch.Tensor], args: argparse.Namespace
) -> None:
    """Print each path's seconds, GB/s and fraction of memcpy; write --json."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    params = sum(t.numel() for t in tensors.values())
    memcpy = results["memcpy"]
    gb = nbytes / 1e9
    rows = [
        {
            "path": k,
            "seconds": round(v, 4),
            "GB_per_s": round(gb / v, 2),
            "vs_memcpy": round(memcpy / v, 3),
        }
        for k, v in results.items()
    ]
    cuda = args.device == "cuda"
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"\n{params / 1e6:.1f}M parameters, {gb:.2f} GB {args.dtype}, {where}, best of "
        f"{args.repeats}"
    )
    print("| path | seconds | GB/s | fraction of memcpy |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['path']} | {r['seconds']} | {r['GB_per_s']} | {r['vs_memcpy']:.0%} |")
    if args.preset:
        nccl = results.get("distributed_nccl")
        nccl_note = (
            "NCCL needs the engine on a second GPU: not measured on this machine"
            if nccl is None
            else f"NCCL to a second GPU: {nccl:.2f} s"
        )
        print(
            f"\ncolocated push of {args.preset}: {results['colocated_process']:.2f} s "
            f"(target < {COLOCATED_TARGET_S:g} s); {nccl_note}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "params": params,
                    "bytes": nbytes,
                    "device": where,
                    "args": vars(args),
                    "results": rows,
                },
                f,
                indent=2,
            )


def gloo_update(engine: Any, tensors: dict[str, torch.Tensor], repeats: int) -> float:
    """update_weights_from_distributed from a trainer rank 0 in a thread of this process."""
    port = free_port()

    def trainer() -> None:  # rank 0: the store waits for the engine to join
        store = dist.PrefixStore(
            "bench",
            dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=120)),
        )
        group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=120))
        for _ in range(repeats):
            for t in tensors.values():
                group.broadcast(t, 0).wait()

    thread = threading.Thread(target=trainer)
    thread.start()
    engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="bench", backend="gloo")
    names = list(tensors)
    dtypes = [str(t.dtype) for t in tensors.values()]
    shapes = [list(t.shape) for t in tensors.values()]
    seconds = best(
        lambda: engine.update_weights_from_distributed(names, dtypes, shapes, "bench"), repeats
    )
    thread.join()
    return seconds


if __name__ == "__main__":
    main()
