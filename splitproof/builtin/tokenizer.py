"""The built-in character tokenizer: one token per character, so a tiny model needs no tokenizer download.

Vocabulary (99 ids, specials first so that they never move when the character set grows):

    0 ``<pad>``   1 ``<eos>``   2 ``<unk>``   3 ``"\\n"``   4..98 the printable ASCII characters 32..126
    (id = ord(c) - 28: space is 4, ``"0"`` is 20, ``"A"`` is 37, ``"a"`` is 69, ``"~"`` is 98).

Any other character (tab, carriage return, non-ASCII) encodes to ``<unk>``. There is no BOS token and no
post-processor, so ``encode`` never adds special tokens (with or without ``add_special_tokens``). The
literal text ``<pad>``, ``<eos>`` or ``<unk>`` in a string encodes to that special token, as Hugging Face
tokenizers treat every added special token.

Chat template: each message renders as ``"{role}: {content}\\n"``; ``add_generation_prompt=True`` appends
``"assistant: "``. So ``[{"role": "user", "content": "3+4="}]`` renders as ``"user: 3+4=\\nassistant: "``.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)
CHARACTERS = ("\n",) + tuple(chr(code) for code in range(32, 127))

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def char_vocab() -> dict[str, int]:
    """Token → id: the special tokens, then newline, then printable ASCII in code-point order."""
    return {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh character tokenizer (see the module docstring for ids, specials and the chat template)."""
    backend = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    backend.decoder = decoders.Fuse()  # join tokens without separators
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # decode must give back the exact characters
    )
