"""Incremental detokenisation that never emits half a character.

Decoding each token on its own breaks multibyte characters (a byte-level BPE token can hold part of a
UTF-8 sequence) and drops the leading space some tokenizers add only between tokens. So we decode a
short window of tokens with its left context and emit only what the window added, and only once the
window no longer ends in U+FFFD (an incomplete sequence). The pieces joined equal
`tokenizer.decode(all_ids)` for the byte-level tokenizers DSV4 ships; the tests check that property.

`skip_special_tokens` never drops DeepSeek's control tokens (`<think>`, `</think>`, `｜DSML｜`): the
reasoning and tool-call parsers read them in the text, and a tokenizer may mark them special.
"""

from __future__ import annotations

import weakref
from typing import Any

from dsv4_engine.tokenizer import TEXT_CONTROL_TOKENS

_REPLACEMENT = "\ufffd"
_SKIPPED: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def skipped_ids(tokenizer: Any) -> frozenset[int]:
    """The ids `skip_special_tokens` drops: the tokenizer's special tokens but the control tokens."""
    ids = _SKIPPED.get(tokenizer)
    if ids is None:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = {i for i, tok in added.items() if getattr(tok, "special", False)}
        special |= set(getattr(tokenizer, "all_special_ids", ()) or ())
        keep = {tokenizer.convert_tokens_to_ids(t) for t in TEXT_CONTROL_TOKENS}
        ids = _SKIPPED[tokenizer] = frozenset(special - keep)
    return ids


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; one instance per generated sequence."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skipped = skipped_ids(tokenizer) if skip_special_tokens else frozenset()
        self.token_ids: list[int] = []
        # token_ids[_prefix:_read] is context already emitted; token_ids[_read:] is not yet emitted.
        self._prefix = 0
        self._read = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._skipped:
            ids = [t for t in ids if t not in self._skipped]
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def push(self, new_ids: list[int], *, final: bool = False) -> str:
        """Add tokens; return the newly complete text (possibly empty). `final` flushes everything."""
        self.token_ids.extend(new_ids)
        if self._read == len(self.token_ids):
            return ""
        context = self._decode(self.token_ids[self._prefix : self._read])
        window = self._decode(self.token_ids[self._prefix :])
        if not final and (len(window) <= len(context) or window.endswith(_REPLACEMENT)):
            return ""  # nothing printable yet, or the last character is still incomplete
        # Only the part past the old context is new; text already sent is never repeated or retracted.
        delta = window[len(context) :]
        self._prefix = self._read
        self._read = len(self.token_ids)
        self.text += delta
        return delta
