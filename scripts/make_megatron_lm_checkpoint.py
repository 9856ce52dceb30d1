"""Write tests/data/megatron_lm_<arch> with Megatron-LM's own save_checkpoint (the code:
tiny/megatron_lm.py)."""

from tiny.megatron_lm import main

if __name__ == "__main__":
    main()
