"""Sync vs partial vs async rollouts on the long-tailed tiny task (the code: bench/long_tail.py)."""

from bench.long_tail import main

if __name__ == "__main__":
    main()
