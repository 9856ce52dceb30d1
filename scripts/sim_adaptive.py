"""The adaptive cost model on simulated machines (the code: bench/sim_adaptive.py)."""

from bench.sim_adaptive import main

if __name__ == "__main__":
    main()
