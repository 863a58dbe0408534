"""The update engine: minibatch schedule, microbatches, log-probs, gradient accumulation and the step."""
