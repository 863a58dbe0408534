"""Built-in pieces that let `splitproof train` run with nothing downloaded: a character tokenizer (and a small model)."""

from .tokenizer import char_tokenizer

__all__ = ["char_tokenizer"]
