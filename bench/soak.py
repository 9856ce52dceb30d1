"""A bounded soak of one engine: `concurrency` clients send mixed requests (streaming or not,
n of 1 or 2, greedy, some aborted at a random moment) to a speculative (NGRAM) engine for
`seconds`, while the weights are swapped between two checkpoints a few times (pause with abort,
update, continue: slime's order). Nothing may be lost: every request completes or is reported
aborted, every completed greedy output equals that prompt's single-request output under the
weights it reports, and every KV slot is free or cached again at the end.

    python -m scripts.soak --seconds 60 --concurrency 64 --weight-updates 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass, field

from safetensors.torch import load_file

from spec_engine import Engine
from tiny.checkpoints import build_tiny_model

MAX_NEW_TOKENS = 24


@dataclass
class SoakReport:
    requests: int = 0
    completed: int = 0
    aborted_by_client: int = 0
    aborted_by_update: int = 0
    weight_updates: int = 0
    mismatches: list[str] = field(default_factory=list)
    lost: int = 0
    kv_used_at_end: int = -1

    @property
    def failures(self) -> int:
        return len(self.mismatches) + self.lost + (self.kv_used_at_end != 0)


def checkpoints(root: str) -> dict[str, str]:
    """Two tiny Llamas with one tokenizer, by the weight version each is served as."""
    return {v: build_tiny_model(f"{root}/{v}", "llama", seed=s) for v, s in (("a", 0), ("b", 1))}


def references(paths: dict[str, str], prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """Each prompt's greedy output, one request at a time, under each checkpoint."""
    out = {}
    for version, path in paths.items():
        with Engine(model_path=path, random_seed=0) as engine:
            out[version] = [
                engine.generate(input_ids=p, sampling_params=_greedy())["output_ids"]
                for p in prompts
            ]
    return out


def _greedy(n: int = 1) -> dict:
    return {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "n": n}


async def soak(seconds: float, concurrency: int, weight_updates: int, seed: int = 0) -> SoakReport:
    rng = random.Random(seed)
    report = SoakReport()
    with tempfile.TemporaryDirectory() as root:
        paths = checkpoints(root)
        prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 12))] for _ in range(16)]
        expected = references(paths, prompts)
        weights = {v: list(load_file(f"{p}/model.safetensors").items()) for v, p in paths.items()}
        with Engine(
            model_path=paths["a"],
            random_seed=0,
            weight_version="a",
            speculative_algorithm="NGRAM",
            max_total_tokens=8192,
        ) as engine:
            deadline = time.perf_counter() + seconds

            async def client(worker: int) -> None:
                local = random.Random(seed * 1000 + worker)
                while time.perf_counter() < deadline:
                    i = local.randrange(len(prompts))
                    n = local.choice((1, 1, 2))
                    rid = f"w{worker}-{report.requests}"
                    report.requests += 1
                    stream = local.random() < 0.4
                    abort_after = local.uniform(0, 0.2) if local.random() < 0.15 else None
                    outs = await _one(engine, prompts[i], n, rid, stream, abort_after)
                    for out in outs:
                        _judge(report, out, expected, i, abort_after is not None)

            async def updater() -> None:
                versions = ["b", "a", "b", "a"]
                for k in range(weight_updates):
                    await asyncio.sleep(seconds / (weight_updates + 1))
                    version = versions[k % len(versions)]
                    await asyncio.to_thread(engine.pause_generation, "abort")
                    await asyncio.to_thread(
                        engine.update_weights_from_tensor,
                        weights[version],
                        weight_version=version,
                    )
                    await asyncio.to_thread(engine.continue_generation)
                    report.weight_updates += 1

            await asyncio.gather(updater(), *(client(w) for w in range(concurrency)))
            report.kv_used_at_end = engine.get_load()["loads"][0]["num_used_tokens"]
    return report


async def _one(
    engine: Engine,
    prompt: list[int],
    n: int,
    rid: str,
    stream: bool,
    abort_after: float | None,
) -> list[dict]:
    """One request's final outputs (n of them), aborting it after `abort_after` seconds."""
    if abort_after is not None:
        asyncio.get_running_loop().call_later(abort_after, engine.abort_request, rid)
    if not stream:
        out = await engine.async_generate(input_ids=prompt, sampling_params=_greedy(n), rid=rid)
        return out if isinstance(out, list) else [out]
    last: dict[int, dict] = {}
    it = await engine.async_generate(
        input_ids=prompt, sampling_params=_greedy(n), rid=rid, stream=True
    )
    async for chunk in it:
        last[chunk.get("index", 0)] = chunk
    return [last[k] for k in sorted(last)]


def _judge(report: SoakReport, out: dict, expected: dict, prompt: int, may_abort: bool) -> None:
    meta = out["meta_info"]
    reason = meta["finish_reason"]
    if reason is None:
        report.lost += 1
    elif reason["type"] == "abort":
        if may_abort:
            report.aborted_by_client += 1
        else:
            report.aborted_by_update += 1
    else:
        report.completed += 1
        want = expected[meta["weight_version"]][prompt]
        if out["output_ids"] != want:
            report.mismatches.append(f"{meta['id']} under {meta['weight_version']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--weight-updates", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    report = asyncio.run(soak(args.seconds, args.concurrency, args.weight_updates, args.seed))
    print(
        f"soak: {report.requests} requests ({report.completed} outputs completed, "
        f"{report.aborted_by_client} aborted by their client, {report.aborted_by_update} aborted "
        f"by a weight update's pause), {args.concurrency} concurrent clients, "
        f"{report.weight_updates} weight updates, {time.perf_counter() - start:.0f} s; "
        f"lost {report.lost}, greedy mismatches {len(report.mismatches)}, KV tokens still held "
        f"{report.kv_used_at_end}; failures {report.failures}"
    )
    raise SystemExit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
