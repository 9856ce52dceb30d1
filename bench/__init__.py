"""The benchmark harness: the code behind the `python -m scripts.bench_*`, `scripts.soak`,
`scripts.sim_adaptive` and `scripts.gpu.*` commands (each command calls a module's main).

One module per benchmark: engine (spec_engine against transformers), rollout (every speculative
algorithm against plain decoding), step_split (where a decode step's time goes), weight_sync
(weight update paths), packing (a train step padded or packed), drift (frozen vs online-trained
draft), soak (an engine under load and weight updates), sim_adaptive (the adaptive cost model on
simulated machines), probe_adaptive (a speculative step's time on a GPU), gpu_summary (the GPU
runbook's results page). Their parts: checkpoints (random checkpoints by shape), prompts,
measure (one engine's timed round), rounds (the rounds over the configurations), isolate (an
engine in a process of its own, and lockstep), rollout_report (the rollout tables and files).
"""
