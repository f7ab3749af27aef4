"""Stop strings over streamed text: hold back only what could still become a stop string.

Text arrives in pieces that need not align with a stop string. We emit everything except the longest
suffix that is a proper prefix of some stop string; when a stop string completes we emit the text
before its earliest occurrence (or through it, with `include`: vLLM's include_stop_str_in_output) and
report which one matched. The same object serves streaming and
non-streaming responses, so both return the same text.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str], *, include: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._include = include
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str, *, final: bool = False, armed: bool = True) -> str:
        """Feed new text; return what may be sent now. After a match, returns "" forever.
        `armed=False` (before `min_tokens` are generated, as vLLM): nothing matches; all text passes."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        if not armed:
            out, self._held = self._held + text, ""
            return out
        # Only a window around the new text can hold a match the held text did not already contain.
        start = max(0, len(self._held) - self._longest + 1)
        buf = self._held + text
        cut, matched = -1, None
        for stop in self._stops:
            i = buf.find(stop, start)
            if i != -1 and (cut == -1 or i < cut):
                cut, matched = i, stop
        if matched is not None:
            self.matched = matched
            self._held = ""
            return buf[: cut + len(matched)] if self._include else buf[:cut]
        if final:
            self._held = ""
            return buf
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
