"""Detokenisation and stop strings: streamed pieces always join to the one-shot result."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_engine.server.detokenizer import IncrementalDetokenizer
from dsv4_engine.server.stops import StopMatcher

MULTIBYTE = "你好，世界 🙂🚀 Привет ça été ≤≥ 😀"


def _chunks(seq: list[Any], cuts: list[int]) -> list[list[Any]]:
    points = sorted({c % (len(seq) + 1) for c in cuts} | {0, len(seq)})
    return [seq[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_pieces_join_to_full_decode(tokenizer: Any, data: st.DataObject) -> None:
    # Random ids hit partial UTF-8 sequences and special tokens; encoded text hits real multibyte runs.
    vocab = len(tokenizer)
    if data.draw(st.booleans()):
        ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=60))
    else:
        text = data.draw(st.text(alphabet=st.sampled_from(MULTIBYTE + "abc xyz\n"), min_size=1, max_size=40))
        ids = tokenizer.encode(text, add_special_tokens=False) or [0]
    skip = data.draw(st.booleans())
    cuts = data.draw(st.lists(st.integers(0, 1000), max_size=20))
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    chunks = _chunks(ids, cuts)
    pieces = [detok.push(c, final=i == len(chunks) - 1) for i, c in enumerate(chunks)]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.text == "".join(pieces)


def test_never_emits_half_a_character(tokenizer: Any) -> None:
    ids = tokenizer.encode("🙂你", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    for i, t in enumerate(ids):
        piece = detok.push([t], final=i == len(ids) - 1)
        assert "\ufffd" not in piece
    assert detok.text == "🙂你"


def _expected(chunks: list[str], stops: list[str]) -> tuple[str, str | None]:
    """Generation stops after the first piece that completes a stop string; the text ends before
    the earliest stop string in the text so far (the reference: search the whole prefix each time)."""
    text = ""
    for c in chunks:
        text += c
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            pos, which = min(hits)
            return text[:pos], which
    return text, None


@settings(max_examples=500, deadline=None)
@given(
    text=st.text(alphabet="abcé🙂", max_size=40),
    stops=st.lists(st.text(alphabet="abcé🙂", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 100), max_size=12),
)
def test_stop_strings_cut_across_piece_boundaries(text: str, stops: list[str], cuts: list[int]) -> None:
    matcher = StopMatcher(stops)
    chunks = ["".join(c) for c in _chunks(list(text), cuts)] or [""]
    out = "".join(matcher.push(c, final=i == len(chunks) - 1) for i, c in enumerate(chunks))
    want, which = _expected(chunks, stops)
    assert out == want
    assert (matcher.matched is None) == (which is None)
    if matcher.matched is not None:
        assert text.startswith(want + matcher.matched)


def test_stop_holds_back_only_a_possible_prefix() -> None:
    matcher = StopMatcher(["END"])
    assert matcher.push("hello E") == "hello "  # "E" could start "END"
    assert matcher.push("x") == "Ex"  # it did not
    assert matcher.push(" EN") == " "
    assert matcher.push("D and more") == ""
    assert matcher.matched == "END"
    assert matcher.push("anything") == ""
