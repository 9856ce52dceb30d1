"""A train step's micro batches: which sequences each holds (plan.py: --micro-batch-size of them,
or as many as fit a token budget), how the model takes them (layout.py: padded, or packed with
--qkv-format thd, and back to the padded layout the losses read), and what megatron's local layer
spec needs to run packed ones (packed_attention.py, thd_ops.py)."""
