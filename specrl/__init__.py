"""specrl: what `scripts/train.py` and a first run need beyond the engine, trainer and rollout
packages: options and their checks, Ray placement, console output, the end-of-run summary and
plots, and the tiny models and task of the CPU run."""
