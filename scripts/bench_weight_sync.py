"""Weight update bandwidth of each engine path (the code: bench/weight_sync.py)."""

from bench.weight_sync import main

if __name__ == "__main__":
    main()
