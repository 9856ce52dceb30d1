"""Where a speculative step's time goes on a GPU (the code: bench/probe_adaptive.py)."""

from bench.probe_adaptive import main

if __name__ == "__main__":
    main()
