"""Test fixtures built locally, for tests, examples, benchmarks and the tiny CPU run: tiny random
Hugging Face checkpoints and a tokenizer (checkpoints.py), and the tiny CPU run's assets: its
model, task and supervised warm-up (run_assets.py). No runtime package imports this one."""
