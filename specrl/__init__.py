"""specrl: what `scripts/train.py` and a first run need beyond the engine, trainer and rollout
packages (tiny models for CPU runs and tests)."""
