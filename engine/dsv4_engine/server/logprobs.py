"""The engine's logprobs (`sampler.TokenLogprobs`, raw model distribution) in OpenAI's shapes, and
in SGLang's for /generate (`sglang_logprobs`).

Chat: `choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}], "refusal": null}`. Completions: `{tokens, token_logprobs, top_logprobs, text_offset}`,
where `top_logprobs[j]` maps token text to logprob for the N most likely tokens plus the sampled one
(so up to N + 1 entries, as OpenAI documents), and `None` stands for the first prompt token, which
nothing predicts. A token's text is `tokenizer.decode([id])` (a byte-level token holding part of a
UTF-8 character decodes to U+FFFD there, as in vLLM); `bytes` are the token's exact bytes.
`text_offset` is each token's offset in the choice's text, counted as the sum of the token texts
before it (vLLM's rule). A logprob below -9999 (or -inf) is sent as -9999.0: JSON has no infinity.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from dsv4_engine.sampler import TokenLogprobs

LOGPROB_FLOOR = -9999.0


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte value -> the printable character that stands for it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars), strict=True))


_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}


class TokenText:
    """Text and bytes of single tokens, cached (a tokenizer's vocabulary does not change)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._raw(token_id)
        return raw

    def _raw(self, token_id: int) -> list[int]:
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(c in _BYTE_OF for c in piece):
                return [_BYTE_OF[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))  # special tokens, other tokenizers


_CACHE: weakref.WeakKeyDictionary[Any, TokenText] = weakref.WeakKeyDictionary()


def token_text(tokenizer: Any) -> TokenText:
    try:
        found = _CACHE.get(tokenizer)
        if found is None:
            found = _CACHE[tokenizer] = TokenText(tokenizer)
        return found
    except TypeError:  # not weak-referenceable: no cache
        return TokenText(tokenizer)


def _value(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps -inf and nan


def chat_content(entries: Sequence[TokenLogprobs], top: int, words: TokenText) -> list[dict[str, Any]]:
    """`logprobs.content` of a chat choice (or of one streamed chunk): `top` alternatives each."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": words.text(token_id), "logprob": _value(logprob), "bytes": words.bytes(token_id)}

    return [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top[:top]]} for e in entries
    ]


def chat_logprobs(entries: Sequence[TokenLogprobs], top: int, words: TokenText) -> dict[str, Any]:
    return {"content": chat_content(entries, top, words), "refusal": None}


class CompletionLogprobs:
    """A completion choice's `logprobs`, built in order (prompt with echo, then output), one call per
    response or streamed chunk; it keeps the running text offset."""

    def __init__(self, words: TokenText, top: int) -> None:
        self.words = words
        self.top = top
        self.offset = 0

    def part(
        self, entries: Sequence[TokenLogprobs | None] | None, token_ids: Sequence[int]
    ) -> dict[str, list[Any]]:
        """The four lists for `token_ids` (entries[j] for token_ids[j]; None: no logprob)."""
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        entries = entries or [None] * len(token_ids)
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self.words.text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_value(entry.logprob))
            alternatives: dict[str, float] = {}
            for t, lp in entry.top[: self.top]:
                alternatives.setdefault(self.words.text(t), _value(lp))
            alternatives.setdefault(text, _value(entry.logprob))  # the sampled token is always there
            out["top_logprobs"].append(alternatives)
        return out


def merge_parts(*parts: dict[str, list[Any]]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in part.items():
            out[key].extend(values)
    return out


def sglang_logprobs(
    entries: Sequence[TokenLogprobs | None],
    token_ids: Sequence[int],
    top: int,
    words: TokenText | None,
) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """SGLang's `*_token_logprobs` and `*_top_logprobs` for `token_ids` (entries[j] for token j; None:
    nothing predicts it): `[logprob, token id, text]` each, text only with `words`
    (`return_text_in_logprobs`), and `top` alternatives per position."""

    def one(token_id: int, logprob: float | None) -> list[Any]:
        value = None if logprob is None else _value(logprob)
        return [value, token_id, None if words is None else words.text(token_id)]

    tokens: list[list[Any]] = []
    tops: list[list[list[Any]] | None] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        tokens.append(one(token_id, None if entry is None else entry.logprob))
        tops.append(None if entry is None else [one(t, lp) for t, lp in entry.top[:top]])
    return tokens, tops
