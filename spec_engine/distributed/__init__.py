"""Tensor parallelism, SGLang's way, on torch.distributed (gloo on CPU, NCCL on CUDA).

`parallel_state`: the TP group a model is built for (rank, size, the collectives its layers
run); `partition`: which heads, vocabulary rows and features a rank holds; `broadcast`: rank 0's
decisions sent to the others (SGLang's `broadcast_pyobj`); `launch`: the ranks an engine starts
beside its own (spawned processes, SGLang's scheduler processes); `token_check`: the
--debug-tp-check-tokens check that every rank sampled the same tokens.
"""
