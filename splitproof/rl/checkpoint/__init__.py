"""Checkpoints of a run: atomic, layout-free files of model, optimizer and RNG states (``store``), and
what a run keeps beside them and how it resumes (``run_state``)."""
