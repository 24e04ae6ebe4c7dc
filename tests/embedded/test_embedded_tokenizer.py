import pytest

from orchestrator.envs.reverse_text import ALPHABET, CLOSE_TAG, OPEN_TAG
from orchestrator.serve import tokenizer as tok


def test_roundtrip_and_rendering():
    text = OPEN_TAG + "hgfedcba" + CLOSE_TAG
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    p = tok.encode_prompt("abc")
    assert p[0] == tok.BOS and p[-1] == tok.SEP and tok.decode(p) == "abc"
    c = tok.encode_completion("cba")
    assert c[-1] == tok.EOS and tok.decode(c) == "cba"


def test_vocabulary_is_exactly_alphabet_tags_and_specials():
    assert set(tok.CHARS) == set(ALPHABET) | set(OPEN_TAG) | set(CLOSE_TAG)
    assert tok.VOCAB_SIZE == 4 + len(tok.CHARS)
    assert len({tok.PAD, tok.BOS, tok.EOS, tok.SEP}) == 4


def test_decode_stops_at_eos_and_drops_specials():
    ids = [tok.BOS, *tok.encode("ab"), tok.SEP, tok.PAD, *tok.encode("c"), tok.EOS, *tok.encode("zz"[:0] + "d")]
    assert tok.decode(ids) == "abc"


def test_unknown_character_and_bad_id_raise():
    with pytest.raises(tok.TokenizerError, match="'z'"):
        tok.encode("abz")
    with pytest.raises(tok.TokenizerError, match="out of range"):
        tok.decode([tok.VOCAB_SIZE])
