"""trainer_bridge: the megatron-core side of specrl (policy training, weight push into engines)."""
