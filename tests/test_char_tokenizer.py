import string

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from splitproof.builtin import char_tokenizer
from splitproof.builtin.tokenizer import CHAT_TEMPLATE, char_vocab

TEXT = string.ascii_letters + string.digits + string.punctuation + " \n" + "Hello, world! 37+45=82\n"


def test_vocab_order_specials_first_then_newline_then_printable_ascii():
    tok = char_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.bos_token_id is None
    assert len(tok) == 99 and len(char_vocab()) == 99
    assert tok.convert_tokens_to_ids("\n") == 3
    for code in range(32, 127):
        assert tok.convert_tokens_to_ids(chr(code)) == code - 28


def test_one_token_per_character_and_exact_decode():
    tok = char_tokenizer()
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT)
    assert ids == [char_vocab()[c] for c in TEXT]
    assert tok.decode(ids) == TEXT  # spaces before punctuation survive: no clean-up of tokenization spaces


def test_no_special_tokens_added_and_unknown_characters():
    tok = char_tokenizer()
    assert tok.encode("ab", add_special_tokens=True) == tok.encode("ab", add_special_tokens=False) == [69, 70]
    assert tok("ab")["input_ids"] == [69, 70]
    assert tok.encode("a\tä") == [69, 2, 2]
    assert tok.decode([69, 1, 0], skip_special_tokens=True) == "a"
    assert tok.decode([69, 1]) == "a<eos>"


def test_chat_template_with_and_without_generation_prompt():
    tok = char_tokenizer()
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "system: Add.\nuser: 3+4=\nassistant: "
    assert tok.apply_chat_template(messages, tokenize=False) == "system: Add.\nuser: 3+4=\n"


def test_save_and_auto_tokenizer_round_trip(tmp_path):
    tok = char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode(TEXT) == tok.encode(TEXT)
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2)
    assert loaded.chat_template == CHAT_TEMPLATE
    assert loaded.decode(tok.encode(TEXT + "<eos>"), skip_special_tokens=True) == TEXT
    assert len(loaded) == 99
