"""specrl: the launcher. The RL loop (loop.py, which `scripts/train.py` runs) and what it needs
beyond the engine, trainer and rollout packages: options and their checks, Ray placement,
checkpoints and resuming, fault tolerance and health checks, console output, the end-of-run
summary and plots. The tiny models and assets of the CPU run are test fixtures, in the `tiny`
package."""
