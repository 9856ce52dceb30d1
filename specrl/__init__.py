"""specrl: what `scripts/train.py` and a first run need beyond the engine, trainer and rollout
packages: options and their checks, Ray placement, console output, the end-of-run summary and
plots. The tiny models and assets of the CPU run are test fixtures, in the `tiny` package."""
