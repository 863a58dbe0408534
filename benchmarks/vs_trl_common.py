"""What both sides of `benchmarks/vs_trl.py` share: the task, the split comparison's optimizer, the update
Δw and the samples' digest."""

from __future__ import annotations

import hashlib
import json

TASK_TRAIN = "builtin://addition/train"

# SGD with learning rate 1, no weight decay and no clipping: the update Δw is minus the gradient, and the
# weights' float32 rounding (about 1e-8) is small next to it.
SPLIT_OPTIMIZER = dict(lr=1.0, weight_decay=0.0)


def delta_of(model_state: dict, start: dict) -> dict:
    """The update Δw = w − w_start of every weight, float64."""
    return {k: (model_state[k].detach().double() - start[k].double()) for k in start}


def digest(tokens) -> str:
    """A short digest of a list of samples (token lists): equal digests, the same samples."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def chat_rows() -> list[dict]:
    """The task's rows with each prompt as one user message (``--model``: a chat model's prompts, which each
    side renders with the model's chat template)."""
    from splitproof.rl.data.tasks import task_rows

    return [dict(row, prompt=[{"role": "user", "content": row["prompt"]}]) for row in task_rows(TASK_TRAIN)]
