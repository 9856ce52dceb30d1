"""What bench/rollout.py reports: the per-configuration table, the adaptive modes against
the better of plain decoding and fixed speculation, the noise floor, the batch-1 roofline, and
the JSON and SVG files."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from typing import Any, Optional

import torch

from specrl.plots import svg

# The plain decoding an algorithm's speculation is compared with: its own target decoding
# without speculation (MTP's target is MiMo, a different model from the others' Llama).
PLAIN_OF = {"mtp": "mtp-plain"}
# Peak HBM bandwidth in GB/s by device name (SXM parts; the PCIe H100 has 2000).
HBM_GBS = {"H100": 3350.0, "H200": 4800.0}


def report(results: list[dict], args: argparse.Namespace) -> None:
    """Print the run's tables and write --plot and --json."""
    base = {r["batch"]: r["tokens_per_s"] for r in results if r["algorithm"] == "baseline"}
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"\n{device} {args.dtype}, hidden {args.hidden_size} x {args.num_layers} layers, vocab "
        f"{args.vocab_size}, "
        f"input {args.input_len}, output {args.output_len}; steps {args.steps}, topk {args.topk}, "
        f"draft tokens {args.draft_tokens}; best of {args.repeats}"
    )
    if args.forced_acceptance:
        print("forced acceptance: every draft token accepted (lossy; speed of a perfect draft)")
    print_table(results, base)
    ratios = adaptive_vs_best(results)
    print_adaptive(ratios)
    noise = noise_floor(results)
    print_noise(noise)
    roof = roofline(results, args.hbm_gbs or device_hbm_gbs(args.device))
    if args.plot:
        with open(args.plot, "w") as f:
            f.write(speedup_svg(results, base))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "device": device,
                    "results": results,
                    "adaptive_vs_best": ratios,
                    "noise": noise,
                    "roofline": roof,
                },
                f,
                indent=2,
            )


def speedup_svg(results: list[dict], base: dict[int, float]) -> str:
    """Tokens/s over plain decoding's at the same batch size, one line per configuration,
    against log2 of the batch size."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        if r["batch"] in base:
            point = (math.log2(r["batch"]), r["tokens_per_s"] / base[r["batch"]])
            series.setdefault(r["algorithm"], []).append(point)
    sizes = ", ".join(str(b) for b in sorted(base))
    return svg(series, "tokens/s vs plain decoding", x_label=f"log2 batch size ({sizes})")


def print_table(results: list[dict], base: dict[int, float]) -> None:
    print(
        "| algorithm | batch | tokens/s | decode tokens/s | vs baseline | accept length | "
        "draft / verify / bookkeeping ms per step | speculative steps |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for r in results:
        speed = f"{r['tokens_per_s'] / base[r['batch']]:.2f}x" if r["batch"] in base else "-"
        ms = r["ms_per_step"]
        split = f"{ms['draft']} / {ms['verify']} / {ms['bookkeeping']}" if ms else "-"
        share = r["speculative_step_share"]
        print(
            f"| {r['algorithm']} | {r['batch']} | {r['tokens_per_s']} | "
            f"{r['decode_tokens_per_s']} | {speed} | {r['accept_length'] or '-'} | {split} | "
            f"{'-' if share is None else f'{100 * share:.0f}%'} |"
        )


def adaptive_vs_best(results: list[dict]) -> list[dict[str, Any]]:
    """Each adaptive row's tokens/s (whole generation and decode only) over the better of its
    algorithm's fixed speculation (`fixed`: None where that was not measured, as at batch sizes
    where it is known to lose: then over plain decoding alone) and its target's plain decoding
    (`plain`) at the same batch size; and `paired_median`, the median over rounds of the same
    ratio taken round by round (under --interleave or --isolate a round of each engine ran one
    after the other, so a slow spell of the machine divides out, where best-of-rounds compares
    different moments)."""
    rows = {(r["algorithm"], r["batch"]): r for r in results}
    out = []
    for r in results:
        name = r["algorithm"]
        if not name.endswith("-adaptive"):
            continue
        fixed = name.removesuffix("-adaptive")
        plain = rows.get((PLAIN_OF.get(fixed, "baseline"), r["batch"]))
        if plain is None:
            continue
        spec = rows.get((fixed, r["batch"]))
        others = [plain] if spec is None else [plain, spec]
        entry: dict[str, Any] = dict(
            algorithm=name,
            batch=r["batch"],
            plain=plain["algorithm"],
            fixed=None if spec is None else fixed,
        )
        for key in ("tokens_per_s", "decode_tokens_per_s"):
            entry[key] = round(r[key] / max(o[key] for o in others), 3)
        for suffix in ("", "_cpu"):
            key = f"round_tokens_per{suffix}_s"
            if all(key in row for row in (r, *others)):
                rounds = zip(r[key], *(o[key] for o in others))
                paired = [a / max(b) for a, *b in rounds]
                entry[f"paired_median{suffix}"] = round(statistics.median(paired), 3)
                entry[f"paired_rounds{suffix}"] = [round(p, 3) for p in paired]
        out.append(entry)
    return out


def print_adaptive(ratios: list[dict[str, Any]]) -> None:
    if not ratios:
        return
    print("\nadaptive / max(plain, fixed), whole generation (decode only; *: fixed not measured):")
    _print_cells(
        ratios,
        lambda e: (
            f"{e['tokens_per_s']:.2f} ({e['decode_tokens_per_s']:.2f})"
            + ("*" if e["fixed"] is None else "")
        ),
    )
    print("\nthe same, round by round: median over rounds")
    _print_cells(
        ratios, lambda e: f"{e['paired_median']:.2f}" + ("*" if e["fixed"] is None else "")
    )
    if all("paired_median_cpu" in e for e in ratios):
        print("\nthe same by the scheduler threads' CPU clocks (--lockstep)")
        _print_cells(ratios, lambda e: f"{e['paired_median_cpu']:.2f}")


def noise_floor(results: list[dict]) -> list[dict[str, Any]]:
    """At each batch size where baseline-twin ran: its tokens/s over baseline's, round by round
    (`paired_median`, `paired_min`, `paired_max`) and best of rounds (`tokens_per_s`). Both run
    the same engine on the same target, so this is the noise of the measurement itself."""
    rows = {(r["algorithm"], r["batch"]): r for r in results}
    out = []
    for r in results:
        base = rows.get(("baseline", r["batch"]))
        if r["algorithm"] != "baseline-twin" or base is None:
            continue
        entry: dict[str, Any] = dict(
            batch=r["batch"], tokens_per_s=round(r["tokens_per_s"] / base["tokens_per_s"], 3)
        )
        for suffix in ("", "_cpu"):
            key = f"round_tokens_per{suffix}_s"
            if key in r and key in base:
                paired = [a / b for a, b in zip(r[key], base[key])]
                entry[f"paired_median{suffix}"] = round(statistics.median(paired), 3)
                entry[f"paired_min{suffix}"] = round(min(paired), 3)
                entry[f"paired_max{suffix}"] = round(max(paired), 3)
        out.append(entry)
    return out


def print_noise(noise: list[dict[str, Any]]) -> None:
    if not noise:
        return
    print("\nbaseline-twin / baseline (identical engines): median over rounds [min, max]")
    print("| batch | median | rounds | best of rounds |")
    print("|---:|---:|---|---:|")
    for e in noise:
        print(
            f"| {e['batch']} | {e['paired_median']:.2f} | [{e['paired_min']:.2f}, "
            f"{e['paired_max']:.2f}] | {e['tokens_per_s']:.2f} |"
        )
    for e in noise:
        if "paired_median_cpu" in e:
            print(
                f"batch {e['batch']} by the CPU clocks: {e['paired_median_cpu']:.2f} "
                f"[{e['paired_min_cpu']:.2f}, {e['paired_max_cpu']:.2f}]"
            )


def _print_cells(ratios: list[dict[str, Any]], cell: Callable[[dict[str, Any]], str]) -> None:
    """A table of `cell` of each adaptive configuration's entry (rows) at each batch size."""
    batches = sorted({e["batch"] for e in ratios})
    print("| | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for name in dict.fromkeys(e["algorithm"] for e in ratios):
        cells = {e["batch"]: e for e in ratios if e["algorithm"] == name}
        row = [cell(cells[b]) if b in cells else "-" for b in batches]
        print(f"| {name} | " + " | ".join(row) + " |")


def roofline(results: list[dict], hbm_gbs: Optional[float]) -> Optional[dict[str, Any]]:
    """Batch-1 plain decoding against weight bytes / HBM bandwidth (printed), or None."""
    one = next((r for r in results if r["algorithm"] == "baseline" and r["batch"] == 1), None)
    if not hbm_gbs or one is None:
        return None
    steps = hbm_gbs * 1e9 / one["weight_bytes"]  # decode steps/s streaming the weights once
    rate = one["decode_tokens_per_s"]
    out = {
        "hbm_gbs": hbm_gbs,
        "weight_bytes": one["weight_bytes"],
        "roofline_steps_per_s": round(steps, 1),
        "batch1_decode_tokens_per_s": rate,
        "fraction": round(rate / round(steps, 1), 3),
    }
    print(
        f"\nbatch-1 plain decode: {rate} tok/s = {100 * out['fraction']:.1f}% of the "
        f"roofline {out['roofline_steps_per_s']} steps/s "
        f"({one['weight_bytes'] / 1e9:.2f} GB of weights at {hbm_gbs:g} GB/s; prefill excluded; "
        "target 90%, SGLang reaches about 75%)"
    )
    return out


def device_hbm_gbs(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((gbs for key, gbs in HBM_GBS.items() if key in name), None)
