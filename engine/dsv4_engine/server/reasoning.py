"""DeepSeek's thinking block split off the answer (`reasoning_content` and `content`), and the thinking
level a request asks for.

With thinking on, the chat template ends the prompt with `<think>`, so the output starts inside the
reasoning and `</think>` ends it (SGLang's `deepseek-r1`/`deepseek-v3` reasoning parsers read it the
same way; a repeated opening `<think>` is dropped). Incremental: text in, in chunks cut anywhere; a
possible partial tag is held back.
"""

from __future__ import annotations

from typing import Any, Literal

from dsv4_engine.server.tool_parser import _partial_suffix
from dsv4_engine.tokenizer import END_THINK, THINK

# OpenAI's `reasoning_effort` (chat) and `reasoning.effort` (Responses) values, and DeepSeek's `max`.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
_THINKING_SWITCHES = ("thinking", "enable_thinking")  # SGLang's and vLLM's chat_template_kwargs


def thinking_kwargs(template_kwargs: dict[str, Any] | None, effort: str | None) -> dict[str, Any]:
    """chat_template_kwargs with an OpenAI reasoning effort mapped onto DeepSeek-V4's thinking levels,
    as SGLang and vLLM map it for DSV4: `none` turns thinking off; `minimal` to `high` turn it on at
    level `high`; `xhigh` and `max` at level `max` (DSV4's template then opens the prompt with its
    maximum-effort instruction). The template receives `thinking` and `reasoning_effort`. An effort
    that contradicts a `thinking` / `enable_thinking` switch the request also sets is a ValueError."""
    kwargs = dict(template_kwargs or {})
    if effort is None:
        return kwargs
    on = effort != "none"
    for switch in _THINKING_SWITCHES:
        if switch in kwargs and bool(kwargs[switch]) != on:
            raise ValueError(
                f"reasoning_effort {effort!r} turns thinking {'on' if on else 'off'}, but "
                f"chat_template_kwargs.{switch} is {kwargs[switch]!r}"
            )
    kwargs["thinking"] = on
    if on:
        kwargs["reasoning_effort"] = "max" if effort in ("xhigh", "max") else "high"
    return kwargs


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
