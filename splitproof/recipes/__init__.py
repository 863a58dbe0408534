"""Hyper-parameter recipes of the built-in models (YAML, verl's key names): see ``rl/config/load.py``."""
