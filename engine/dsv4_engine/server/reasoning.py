"""DeepSeek's thinking block split off the answer: `reasoning_content` and `content`.

With thinking on, the chat template ends the prompt with `<think>`, so the output starts inside the
reasoning and `</think>` ends it (SGLang's `deepseek-r1`/`deepseek-v3` reasoning parsers read it the
same way; a repeated opening `<think>` is dropped). Incremental: text in, in chunks cut anywhere; a
possible partial tag is held back.
"""

from __future__ import annotations

from dsv4_engine.server.tool_parser import _partial_suffix
from dsv4_engine.tokenizer import END_THINK, THINK


class ReasoningSplitter:
    def __init__(self, *, stream: bool = True) -> None:
        self.buf = ""
        self.thinking = True
        self.at_start = True  # nothing of the reasoning released yet (an opening tag may come)
        self.stream = stream  # false: the reasoning comes in one piece, when it ends

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) newly final."""
        if not self.thinking:
            return "", text
        self.buf += text
        if self.at_start:
            if THINK.startswith(self.buf):
                return "", ""  # maybe the opening tag, not yet whole
            if self.buf.startswith(THINK):
                self.buf = self.buf[len(THINK) :]
        i = self.buf.find(END_THINK)
        if i >= 0:
            reasoning, content = self.buf[:i], self.buf[i + len(END_THINK) :]
            self.buf, self.thinking = "", False
            return reasoning, content
        if not self.stream:
            self.at_start = False
            return "", ""
        cut = len(self.buf) - _partial_suffix(self.buf, END_THINK)
        reasoning, self.buf = self.buf[:cut], self.buf[cut:]
        self.at_start = self.at_start and not reasoning
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """The output ended (maybe inside the reasoning, cut short): what is still held."""
        reasoning, self.buf = (self.buf if self.thinking else ""), ""
        return reasoning, ""
