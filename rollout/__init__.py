"""rollout: RL-side orchestration on Ray (engines behind a router, samples, rewards)."""
