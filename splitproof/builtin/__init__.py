"""Built-in pieces that let ``splitproof train`` run with nothing downloaded: a character tokenizer and a
small causal LM over it (``charlm``, built by ``scripts/make_charlm.py`` and shipped inside the package)."""

import os

from .tokenizer import char_tokenizer


def charlm_directory() -> str:
    """Path of the built-in model: a Hugging Face directory (Llama, ~100k parameters, float32) with the
    character tokenizer's files, loadable by ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "charlm")


def addition_reward_model_directory() -> str:
    """Path of the built-in reward model for ``builtin://addition``: a one-label sequence classifier with
    charlm's architecture (``AutoModelForSequenceClassification``), trained from the task's rule by
    ``scripts/train_reward_model.py`` (docs/reward-models.md)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "addition_rm")


__all__ = ["addition_reward_model_directory", "char_tokenizer", "charlm_directory"]
