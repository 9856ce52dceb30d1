"""Decode throughput of spec_engine against transformers (the code: bench/engine.py)."""

from bench.engine import main

if __name__ == "__main__":
    main()
