"""Host reads per step and tokens/s of plain and EAGLE-3 decoding with a tiny model (the code:
bench/host_read_table.py)."""

from bench.host_read_table import main

if __name__ == "__main__":
    main()
