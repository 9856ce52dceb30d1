"""A train step with and without sequence packing (the code: bench/packing.py)."""

from bench.packing import main

if __name__ == "__main__":
    main()
