"""Rollout throughput of every speculative algorithm (the code: bench/rollout.py)."""

from bench.rollout import main

if __name__ == "__main__":
    main()
