"""Built-in pieces that let ``splitproof train`` run with nothing downloaded: a character tokenizer."""

from .tokenizer import char_tokenizer

__all__ = ["char_tokenizer"]
