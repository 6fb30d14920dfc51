"""Incremental detokenization: deltas add up to the text, stop strings are cut and held back,
split UTF-8 characters wait for their last byte.

`ByteTokenizer` stands in for a real one (a unit test of the text logic): token id t is the
byte t, plus one special token that decodes to "<eos>" unless skipped.
"""
from __future__ import annotations

from pdserve.engine.detokenizer import Detokenizer

SPECIAL = 256


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = b"".join(b"" if t == SPECIAL and skip_special_tokens else
                       (b"<eos>" if t == SPECIAL else bytes([t])) for t in ids)
        return out.decode("utf-8", errors="replace")


def encode(text: str) -> list[int]:
    return list(text.encode())


def push_all(detok: Detokenizer, ids: list[int]) -> list[str]:
    deltas = []
    for t in ids:
        deltas.append(detok.push(t))
        if detok.stopped_by is not None:
            break
    return deltas


def test_deltas_add_up_to_the_text():
    detok = Detokenizer(ByteTokenizer())
    deltas = push_all(detok, encode("hello world"))
    assert deltas == list("hello world")
    assert detok.flush() == ""


def test_no_tokenizer_means_no_text():
    detok = Detokenizer(None)
    assert detok.push(5) == ""
    assert detok.flush() == ""


def test_split_utf8_character_waits_for_its_last_byte():
    detok = Detokenizer(ByteTokenizer())
    e_acute = encode("é")  # two bytes
    assert detok.push(ord("a")) == "a"
    assert detok.push(e_acute[0]) == ""
    assert detok.push(e_acute[1]) == "é"


def test_stop_string_is_cut_and_not_returned():
    detok = Detokenizer(ByteTokenizer(), stop=("END",))
    text = "".join(push_all(detok, encode("abc END more")))
    assert detok.stopped_by == "END"
    assert text + detok.flush() == "abc "


def test_possible_stop_prefix_is_held_back_then_released():
    detok = Detokenizer(ByteTokenizer(), stop=("STOP",))
    deltas = push_all(detok, encode("a ST"))
    assert "".join(deltas) == "a "  # "ST" could still become "STOP"
    assert detok.push(ord("x")) == "STx"  # it did not
    assert detok.stopped_by is None
    assert detok.flush() == ""


def test_stop_string_spanning_many_tokens_after_emitted_text():
    detok = Detokenizer(ByteTokenizer(), stop=("\n\n", "###"))
    text = "".join(push_all(detok, encode("line one\nline two\n\nthree")))
    assert detok.stopped_by == "\n\n"
    assert text + detok.flush() == "line one\nline two"


def test_the_first_stop_string_to_complete_wins():
    detok = Detokenizer(ByteTokenizer(), stop=("cd", "bcde"))
    text = "".join(push_all(detok, encode("abcdef")))
    assert detok.stopped_by == "cd"
    assert text + detok.flush() == "ab"


def test_at_end_flush_returns_the_held_tail():
    detok = Detokenizer(ByteTokenizer(), stop=("xyz",))
    text = "".join(push_all(detok, encode("abx")))
    assert text == "ab"
    assert detok.flush() == "x"


def test_special_tokens_skipped_or_kept():
    skipping = Detokenizer(ByteTokenizer(), skip_special_tokens=True)
    keeping = Detokenizer(ByteTokenizer(), skip_special_tokens=False)
    ids = encode("hi") + [SPECIAL]
    assert "".join(push_all(skipping, ids)) == "hi"
    assert "".join(push_all(keeping, ids)) == "hi<eos>"
