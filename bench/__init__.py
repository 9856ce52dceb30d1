"""The benchmark harness: what the `python -m scripts.bench_*`, `scripts.soak`,
`scripts.sim_adaptive` and `scripts.gpu.*` commands run, one module per benchmark."""
