"""Rollout throughput and acceptance of every speculative algorithm against plain decoding.

    python -m scripts.bench_rollout                           # random ~56M Llama on CPU
    python -m scripts.bench_rollout --preset llama-3.1-8b --device cuda --dtype bfloat16
    --batch-sizes 1 8 64

For each configuration and batch size: output tokens/s over a whole greedy generation
(prefill included), the decode-only rate (the same generation less a prefill-only run of the
same prompts), the mean accept length (tokens per verify, SGLang's count), and the time per
decode step split into draft, verify and bookkeeping. Drafts are random checkpoints of the
right shape (EAGLE-2, EAGLE-3, MiMo MTP), so their acceptance is near 1 and they measure the
overhead; STANDALONE with the target as its own draft accepts every token (the upper bound);
NGRAM runs on prompts that repeat a pattern, as code or templated text does (--interleave: all
configurations' engines at once, rounds round-robin, the order turning by one each round; the
JSON keeps every round's tokens/s and the adaptive rows' median of per-round ratios; --isolate:
the same rounds, each engine in a fresh process every round, for comparisons finer than the ~10%
an engine's memory layout moves it on CPU; --lockstep: those fresh processes all open at once,
taking one scheduler step each in turn and timing their own steps, for a machine whose speed
drifts within a round, by the wall clock and by each scheduler thread's CPU clock (which leaves
out the time a step waited for a core on a shared machine); --in-process: those engines in
threads of this one process);
ngram-adaptive, eagle3-adaptive and mtp-adaptive (and, on request, standalone-self-adaptive and
standalone-imitate-adaptive) add --speculative-adaptive (per step, decode plainly or speculate at
a depth up to the configured one, by the measured cost model; the table gives the share of decode
steps that speculated, the JSON the steps run at each depth), and each is compared with the
better of its fixed speculation and plain decoding of the same target (mtp-plain: the MiMo target
without MTP). standalone-imitate (on request) drafts with a noisy copy of the target
(--imitate-noise), which agrees with it on most tokens but not all. baseline-twin (on request)
is a second plain engine of the baseline's target: the same work, so
its ratio to baseline round by round (`noise` in the JSON) is the bench's noise between two
identical engines, the margin below which the adaptive rows' ratios say nothing.
--forced-acceptance makes every draft token accepted (sampling at temperature 1 with
--speculative-accept-threshold-single 1e-9: lossy, a speed measurement only), which is what a
perfect draft would give: the engine's speculative speedup at full acceptance, against plain
decoding with the same sampling in the same run. --model-path / --eagle3-draft-path run real
checkpoints instead of random ones. On CUDA the batch-1 baseline is compared with the
memory-bandwidth roofline: weight bytes / HBM bandwidth (--hbm-gbs, known for H100/H200) bounds
decode steps per second.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from bench.checkpoints import PRESETS, apply_preset, cached, perturbed_copy, work_dir
from bench.rollout_report import report
from bench.rounds import run
from tiny.checkpoints import add_mimo_mtp, build_checkpoint, build_eagle_draft

ALGORITHMS = (
    "baseline",
    "eagle",
    "eagle3",
    "mtp",
    "mtp-plain",
    "standalone-self",
    "ngram",
    "ngram-adaptive",
    "eagle3-adaptive",
    "mtp-adaptive",
)
# Not run by default: the self-draft (all drafts accepted) adaptive, where depth matters most; a
# draft that imitates the target (a noisy copy: most drafts accepted, not all); and a second plain
# engine of the baseline's target (the control that measures the bench's noise).
CHOICES = ALGORITHMS + (
    "standalone-self-adaptive",
    "standalone-imitate",
    "standalone-imitate-adaptive",
    "baseline-twin",
)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    table = configs(build_models(args), args.steps, args.topk, args.draft_tokens)
    if args.forced_acceptance:
        for name, (_, kwargs) in table.items():
            if name not in ("baseline", "mtp-plain"):
                kwargs["speculative_accept_threshold_single"] = 1e-9
    results = []
    for batch in args.batch_sizes:
        for name, row in run(table, args.algorithms, batch, args).items():
            results.append({"algorithm": name, **row})
            print(json.dumps(results[-1]), flush=True)
    order = {name: i for i, name in enumerate(args.algorithms)}
    results.sort(key=lambda r: (order[r["algorithm"]], r["batch"]))
    report(results, args)


def configs(
    models: dict[str, str], steps: int, topk: int, tokens: int
) -> dict[str, tuple[str, dict]]:
    """Every algorithm's (target, engine kwargs); drafts that were not built are absent (None)."""
    models = {"eagle": None, "eagle3": None, "mimo": None, "imitate": None, **models}
    tree = dict(
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=tokens,
    )
    table = {
        "baseline": (models["llama"], {}),
        "baseline-twin": (models["llama"], {}),
        "eagle": (
            models["llama"],
            dict(
                speculative_algorithm="EAGLE", speculative_draft_model_path=models["eagle"], **tree
            ),
        ),
        "eagle3": (
            models["llama"],
            dict(
                speculative_algorithm="EAGLE3",
                speculative_draft_model_path=models["eagle3"],
                **tree,
            ),
        ),
        "mtp": (
            models["mimo"],
            dict(
                speculative_algorithm="EAGLE", speculative_num_steps=steps, speculative_eagle_topk=1
            ),
        ),
        "mtp-plain": (models["mimo"], {}),  # MTP's target decoding plainly: its plain reference
        # STANDALONE chains: the target itself as its draft (every draft accepted), or a noisy
        # copy of it (most accepted)
        **{
            name: (
                models["llama"],
                dict(
                    speculative_algorithm="STANDALONE",
                    speculative_draft_model_path=models[draft],
                    speculative_num_steps=steps,
                    speculative_eagle_topk=1,
                ),
            )
            for name, draft in (("standalone-self", "llama"), ("standalone-imitate", "imitate"))
        },
        "ngram": (
            models["llama"],
            dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=tokens),
        ),
    }
    # --speculative-adaptive: per step, the algorithm or plain decoding, by the measured cost model.
    for name in ("ngram", "eagle3", "mtp", "standalone-self", "standalone-imitate"):
        target, kwargs = table[name]
        table[f"{name}-adaptive"] = (target, {**kwargs, "speculative_adaptive": True})
    return table


def build_models(args: argparse.Namespace) -> dict[str, str]:
    """The checkpoints the chosen algorithms run, by role (llama, eagle, eagle3, mimo):
    --model-path's and --eagle3-draft-path's, else random ones of the flags' shape, built under
    --work-dir (or found there from an earlier run)."""
    root = work_dir(args.work_dir, "bench-rollout-", args)
    shape = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size or int(args.hidden_size * 2.75),
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        max_position_embeddings=args.context_length,
        initializer_range=0.02,
    )
    # Checkpoints in the benchmark dtype (an 8B model in float32 would need 32 GB of disk), only
    # those needed.
    save = "float32" if args.dtype == "float32" else args.dtype
    # An adaptive configuration runs its algorithm's checkpoints.
    wanted = (
        {a.removesuffix("-adaptive") for a in args.algorithms} if args.model_path is None else set()
    )
    models = {
        "llama": args.model_path
        or (
            cached(
                os.path.join(root, "llama"),
                lambda d: build_checkpoint(
                    d, arch="llama", dtype=save, init_device=args.device, **shape
                ),
            )
            if wanted - {"mtp", "mtp-plain"}
            else ""
        ),
        "eagle3": args.eagle3_draft_path,
    }
    if "eagle" in wanted:
        models["eagle"] = cached(
            os.path.join(root, "eagle"),
            lambda d: build_eagle_draft(d, models["llama"], version=2, std=0.02),
        )
    if "eagle3" in wanted:
        models["eagle3"] = cached(
            os.path.join(root, "eagle3"),
            lambda d: build_eagle_draft(
                d, models["llama"], version=3, std=0.02, draft_vocab_size=min(8192, args.vocab_size)
            ),
        )
    if "standalone-imitate" in wanted:
        models["imitate"] = cached(
            os.path.join(root, f"imitate-{args.imitate_noise}"),
            lambda d: perturbed_copy(models["llama"], d, args.imitate_noise),
        )
    if wanted & {"mtp", "mtp-plain"}:
        models["mimo"] = cached(
            os.path.join(root, "mimo"),
            lambda d: add_mimo_mtp(
                build_checkpoint(d, arch="qwen2", dtype=save, init_device=args.device, **shape),
                std=0.02,
            ),
        )
    return models


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The flags, with --preset's shape applied; with --model-path, its vocabulary and only the
    configurations a real checkpoint can run (no random drafts)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _shape_flags(parser)
    _round_flags(parser)
    _engine_flags(parser)
    _input_output_flags(parser)
    args = parser.parse_args(argv)
    if args.in_process and not (args.isolate or args.lockstep):
        parser.error("--in-process opens each round's engines afresh: add --lockstep or --isolate")
    apply_preset(args)
    if args.model_path is not None:
        real = {"baseline", "standalone-self", "ngram"} | (
            {"eagle3"} if args.eagle3_draft_path else set()
        )
        args.algorithms = [a for a in args.algorithms if a.removesuffix("-adaptive") in real]
        with open(os.path.join(args.model_path, "config.json")) as f:
            args.vocab_size = json.load(f)["vocab_size"]
    return args


def _shape_flags(parser: argparse.ArgumentParser) -> None:
    """The model's shape (random weights), the attention backend, the roofline's bandwidth."""
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), help="a real model's shape (overrides the shape flags)"
    )
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--intermediate-size", type=int, help="default: 2.75 x hidden size")
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument(
        "--attention-backend",
        choices=["torch_native", "flashinfer"],
        help="default: the engine's (flashinfer on CUDA when installed)",
    )
    parser.add_argument(
        "--hbm-gbs",
        type=float,
        help="HBM bandwidth for the roofline (default: known for H100/H200)",
    )


def _round_flags(parser: argparse.ArgumentParser) -> None:
    """What is measured, and how the rounds run."""
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=CHOICES)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--draft-tokens", type=int, default=5)
    parser.add_argument(
        "--imitate-noise",
        type=float,
        default=0.1,
        help="standalone-imitate's draft: the target with noise of this many standard deviations "
        "of each weight matrix added (0: the target itself)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="per batch size, open every configuration's engine at once and run the rounds "
        "round-robin (side by side on a machine whose speed drifts; needs the memory of all)",
    )
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="rounds round-robin as --interleave, but each configuration's engine in a fresh "
        "process every round (on CPU an engine's speed depends on where its memory landed: up "
        "to ~10%% per instance; see bench/isolate.py)",
    )
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="as --isolate, but each round's engines open at once and take one scheduler step "
        "each in turn, each timing only its own steps (a machine whose speed drifts over "
        "seconds slows them all alike; see bench/isolate.py)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="with --isolate or --lockstep: each round's fresh engines in threads of this one "
        "process instead of processes of their own (side by side in one process; give torch one "
        "thread, OMP_NUM_THREADS=1, for the CPU clocks to see all of a step's work)",
    )


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant engines (what it costs: docs/benchmarks/deterministic_cpu.md)",
    )
    parser.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="no graph batch sizes / padding (to measure what padding costs where graphs are not "
        "replayed)",
    )
    parser.add_argument(
        "--forced-acceptance",
        action="store_true",
        help="accept every draft token (sampling, lossy): the speedup a perfect draft would give",
    )


def _input_output_flags(parser: argparse.ArgumentParser) -> None:
    """Real checkpoints instead of random ones, where random ones are built, what is written."""
    parser.add_argument(
        "--model-path", help="a real target checkpoint instead of a random one (its own shape)"
    )
    parser.add_argument("--eagle3-draft-path", help="with --model-path: its EAGLE-3 draft")
    parser.add_argument(
        "--work-dir",
        help="where the random checkpoints are built, and found again by a later run of the same "
        "shape (an 8B model takes minutes to build); default: a fresh temporary directory",
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument(
        "--plot", help="also write an SVG of each configuration's speedup over plain decoding"
    )


if __name__ == "__main__":
    main()
