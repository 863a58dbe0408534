"""The RL step around the update engine: data, rollout, rewards, advantages, the loop."""
