"""The --speculative-adaptive cost model (spec_engine/speculative/adaptive/) on simulated
machines: its tokens/s as a share of the best fixed mode's, per machine and cost set, for each
NOISE setting (inf: costs compared as measured, without scaling them by the reference mode's
moves).

    python -m scripts.sim_adaptive --seeds 16 --steps 768 --noise 1.0 1.1 1.2 inf

A step of mode m (0: plain, d: depth d of a chain whose drafts are all accepted) takes
cost[m] * speed * (1 + U(0, --step-noise)) seconds per request; the machine's speed is steady
(1.0), changes in spells (every 40 steps one of 1.0, 1.0, 1.2, 1.4) or follows a wave
(1.2 + 0.2 sin(step / 30)). The best fixed mode's time for the same tokens at the same speeds is
the yardstick, so 1.0 is a model that always runs the best mode and never tries another.
"""

from __future__ import annotations

import argparse
import math
import random

from spec_engine.speculative.adaptive import costs
from spec_engine.speculative.adaptive.model import SpecCostModel

COSTS = {  # seconds per request per step: plain, depth 1, 2, 3
    "plain-better": (3.0, 7.5, 11.25, 15.0),  # run 5's STANDALONE-self at batch 8
    "close": (3.0, 6.3, 9.6, 12.6),  # plain 5% ahead of depth 3
    "spec-close": (3.0, 6.0, 8.5, 11.5),  # depth 3 4% ahead of plain
    "spec-better": (3.0, 5.0, 7.0, 9.0),
}
MACHINES = ("steady", "spells", "wave")


def speed(machine: str, step: int, rng: random.Random, now: float) -> float:
    """The machine's slowdown at `step` (`now`: the last step's)."""
    if machine == "spells":
        return rng.choice([1.0, 1.0, 1.2, 1.4]) if step % 40 == 0 else now
    if machine == "wave":
        return 1.2 + 0.2 * math.sin(step / 30)
    return 1.0


def efficiency(cost: tuple[float, ...], machine: str, seed: int, args: argparse.Namespace) -> float:
    """The model's tokens/s over the best fixed mode's, on one simulated generation."""
    rng = random.Random(seed)
    model = SpecCostModel([1, 2, 3], nested=True)
    best = max(range(4), key=lambda m: (m + 1) / cost[m])
    taken = yardstick = 0.0
    slow = 1.0
    for step in range(args.steps):
        slow = speed(machine, step, rng, slow)
        mode = model.choose(8)
        seconds = cost[mode] * slow * (1 + rng.uniform(0, args.step_noise))
        taken += seconds
        yardstick += cost[best] * slow * (1 + args.step_noise / 2) * (mode + 1) / (best + 1)
        model.observe(mode, 8, 8 * seconds, [[0] * (mode + 1)] * 8 if mode else ())
    return yardstick / taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=768, help="decode steps per generation")
    parser.add_argument("--step-noise", type=float, default=0.15)
    parser.add_argument("--noise", type=float, nargs="+", default=[costs.NOISE, math.inf])
    args = parser.parse_args()
    cells = [(name, machine) for name in COSTS for machine in MACHINES]
    print("| NOISE | " + " | ".join(f"{n} {m}" for n, m in cells) + " | mean | min |")
    print("|---" * (len(cells) + 3) + "|")
    for noise in args.noise:
        costs.NOISE = noise
        shares = [
            sum(efficiency(COSTS[n], m, s, args) for s in range(args.seeds)) / args.seeds
            for n, m in cells
        ]
        row = " | ".join(f"{x:.3f}" for x in shares)
        print(f"| {noise} | {row} | {sum(shares) / len(shares):.4f} | {min(shares):.3f} |")


if __name__ == "__main__":
    main()
