"""The RL step around the update engine, and the trainer around the step.

Start with ``step.py`` (one training step, top to bottom), then ``loop.py`` and ``train.py``. The
subpackages are the step's stages, in the order data flows: ``data`` → ``rollout`` → ``rewards`` →
advantages (``splitproof.advantages``) → the batch (``rollout.assemble``) → the engine; and the
trainer's parts: ``config``, ``models``, ``checkpoint``, ``tracking``."""
