"""`stopstrings.py`: committed tokens to text, cut at an end-of-sequence token or a stop
string (held back while it may be the start of one)."""

from conftest import ByteTokenizer

from mlxspec.stats import Stats
from mlxspec.stopstrings import Detokenizer


def test_text_stops_at_a_stop_string_held_back_until_known():
    detok = Detokenizer(ByteTokenizer(), ["END"], Stats())
    first = detok.feed(list(b"abE"))
    assert "E" not in first.text and first.finish_reason is None  # "E" may start "END"
    out = detok.feed(list(b"ND!"))
    assert first.text + out.text == "ab" and out.finish_reason == "stop"
    assert out.stop_string == "END" and detok.done


def test_an_end_of_sequence_token_ends_the_text_and_is_not_emitted():
    tok = ByteTokenizer()
    tok.eos_token_ids = {0}
    detok = Detokenizer(tok, [], Stats())
    out = detok.feed([104, 105, 0, 33])
    assert out.text == "hi" and out.tokens == [104, 105] and out.finish_reason == "stop"


def test_the_last_step_of_max_tokens_ends_with_length():
    detok = Detokenizer(ByteTokenizer(), [], Stats())
    out = detok.feed(list(b"ok"), last=True)
    assert out.text == "ok" and out.finish_reason == "length"
