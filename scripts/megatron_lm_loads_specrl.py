"""Megatron-LM's own load_checkpoint reads a specrl --save checkpoint (the code:
bench/megatron_lm_loads.py)."""

from bench.megatron_lm_loads import main

if __name__ == "__main__":
    main()
