"""Decode throughput at several --tp-size values (the code: bench/tensor_parallel.py)."""

from bench.tensor_parallel import main

if __name__ == "__main__":
    main()
