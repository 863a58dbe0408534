"""The RL step around the update engine: data, rollout, rewards, KL in reward, advantages."""
