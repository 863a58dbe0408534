"""The RL step around the update engine: data → rollout → rewards → KL in reward → advantages → the
engine's update, and the training loop, its config and checkpoints."""
