"""Prompts: files (Parquet, JSON Lines) and built-in tasks read into rows, tokenized and checked before
any model is loaded, and the seeded order in which a run consumes them."""

from .prompts import PromptDataset, PromptRecord, PromptSampler, load_prompts

__all__ = ["PromptDataset", "PromptRecord", "PromptSampler", "load_prompts"]
