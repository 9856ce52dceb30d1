"""Weight update bandwidth of each engine path against a plain memcpy of the same bytes.

    python -m scripts.bench_weight_sync                 # random ~100M-parameter Llama, CPU

Paths: update_weights_from_tensor with (name, tensor) pairs, with flattened per-dtype buckets,
with torch.multiprocessing reduce_tensor handles (shared memory on CPU, CUDA IPC on GPU); a
gloo broadcast from a trainer rank (update_weights_from_distributed); a safetensors checkpoint
(update_weights_from_disk). Each time is the engine call, best of --repeats, including the
check of every tensor and the rebuild of derived copies (on CPU the oneDNN-packed weights,
also timed on their own). The ceiling is torch copy_ of one flat buffer of the same size.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from specrl.tiny_models import build_checkpoint
from trainer_bridge.megatron_compat import free_port


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden-size", type=int, default=640)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()

    from torch.multiprocessing.reductions import reduce_tensor

    from spec_engine import Engine
    from spec_engine.weights.loader import refresh_derived
    from spec_engine.weights.transport import FlattenedBucket

    root = tempfile.mkdtemp(prefix="bench-weights-")
    path = build_checkpoint(
        os.path.join(root, "model"),
        arch="llama",
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=int(args.hidden_size * 2.7),
        num_layers=args.num_layers,
        num_heads=max(1, args.hidden_size // 64),
        num_kv_heads=max(1, args.hidden_size // 128),
        initializer_range=0.02,
    )
    tensors = load_file(os.path.join(path, "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    params = sum(t.numel() for t in tensors.values())
    src, dst = (
        torch.cat([t.reshape(-1) for t in tensors.values()]),
        torch.empty(params, device="cpu"),
    )
    memcpy = best(lambda: dst.copy_(src), args.repeats)
    results = {"memcpy": memcpy}
    engine = Engine(model_path=path, skip_tokenizer_init=True, random_seed=0, max_total_tokens=4096)
    try:
        named = list(tensors.items())
        engine.update_weights_from_tensor(named)  # warm-up: first-touch allocations
        results["tensor"] = best(lambda: engine.update_weights_from_tensor(named), args.repeats)
        buckets = [b.to_dict() for b in FlattenedBucket.pack(named)]
        results["flattened_bucket"] = best(
            lambda: engine.update_weights_from_tensor(buckets, load_format="flattened_bucket"),
            args.repeats,
        )
        handles = [(n, reduce_tensor(t.share_memory_())) for n, t in named]
        results["ipc_handles"] = best(
            lambda: engine.update_weights_from_tensor(handles), args.repeats
        )

        port = free_port()

        def trainer() -> None:  # rank 0: the store waits for the engine to join
            store = dist.PrefixStore(
                "bench",
                dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=120)),
            )
            group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=120))
            for _ in range(args.repeats):
                for t in tensors.values():
                    group.broadcast(t, 0).wait()

        thread = threading.Thread(target=trainer)
        thread.start()
        engine.init_weights_update_group(
            "127.0.0.1", port, 1, 2, group_name="bench", backend="gloo"
        )
        names = list(tensors)
        dtypes = [str(t.dtype) for t in tensors.values()]
        shapes = [list(t.shape) for t in tensors.values()]
        results["distributed_gloo"] = best(
            lambda: engine.update_weights_from_distributed(names, dtypes, shapes, "bench"),
            args.repeats,
        )
        thread.join()
        results["disk"] = best(lambda: engine.update_weights_from_disk(path), args.repeats)
        # Derived CPU copies alone (oneDNN-packed weights; none on CUDA), included in every path
        # above.
        results["cpu_repack_only"] = best(
            lambda: refresh_derived(engine.runner.model), args.repeats
        )
    finally:
        engine.shutdown()

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
    print(
        f"\n{params / 1e6:.1f}M parameters, {gb:.2f} GB float32, CPU, {torch.get_num_threads()} "
        "threads, "
        f"best of {args.repeats}"
    )
    print("| path | seconds | GB/s | fraction of memcpy |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['path']} | {r['seconds']} | {r['GB_per_s']} | {r['vs_memcpy']:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"params": params, "bytes": nbytes, "args": vars(args), "results": rows},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
