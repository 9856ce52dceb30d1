"""A bounded soak of one engine (the code: bench/soak.py)."""

from bench.soak import main

if __name__ == "__main__":
    main()
