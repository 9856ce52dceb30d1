"""How a trainer rank shares the work with the others, beyond megatron's own tensor parallelism:
data parallelism (data.py: its share of a batch, reductions over its replicas), expert parallelism
(expert.py: an MoE model's routed experts over ranks) and sequence parallelism (sequence.py: MoE
and MLA models under tensor parallelism). megatron_compat.init_model_parallel sets the groups up."""
