"""One chat choice's output text as OpenAI message fields: `content`, `reasoning_content` (thinking
split off, server/reasoning.py) and `tool_calls` (DSML parsed, server/tool_parser.py), whole or as
stream deltas, both through the same incremental parsers."""

from __future__ import annotations

from typing import Any

from dsv4_engine.server.protocol import ChatCompletionRequest
from dsv4_engine.server.reasoning import ReasoningSplitter
from dsv4_engine.server.tool_parser import CallDelta, ToolCallParser


def separates_reasoning(req: ChatCompletionRequest) -> bool:
    return req.thinking() and req.separate_reasoning is not False


def parses_tools(req: ChatCompletionRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


class ChatOutput:
    def __init__(self, req: ChatCompletionRequest) -> None:
        self.reasoning = (
            ReasoningSplitter(stream=req.stream_reasoning is not False) if separates_reasoning(req) else None
        )
        self.tools = ToolCallParser() if parses_tools(req) else None
        # `parallel_tool_calls: false`: one call; the model's further calls are dropped
        self.max_calls = 1 if req.parallel_tool_calls is False else None
        self.calls: dict[int, dict[str, Any]] = {}

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def _fields(self, reasoning: str, content: str, calls: list[CallDelta]) -> dict[str, Any]:
        if self.max_calls is not None:
            calls = [c for c in calls if c.index < self.max_calls]
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [c.openai() for c in calls]
            for c in calls:
                if c.name is not None:
                    self.calls[c.index] = c.openai()
                else:
                    self.calls[c.index]["function"]["arguments"] += c.arguments or ""
        return delta

    def delta(self, text: str) -> dict[str, Any]:
        """The fields of the next stream delta for newly generated `text` (empty: all held back)."""
        reasoning, content = self.reasoning.push(text) if self.reasoning else ("", text)
        if self.tools is None:
            return self._fields(reasoning, content, [])
        parsed = self.tools.push(content)
        return self._fields(reasoning, parsed.content, parsed.calls)

    def finish(self) -> dict[str, Any]:
        """The fields of what was held back, once the output ended."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        if self.tools is None:
            return self._fields(reasoning, content, [])
        first = self.tools.push(content)
        last = self.tools.finish()
        return self._fields(reasoning, first.content + last.content, first.calls + last.calls)

    def message(self, text: str) -> dict[str, Any]:
        """The whole message for a finished output `text`."""
        parts = [self.delta(text), self.finish()]
        content = "".join(p.get("content", "") for p in parts)
        msg: dict[str, Any] = {"role": "assistant", "content": content or (None if self.calls else "")}
        if self.reasoning is not None:
            msg["reasoning_content"] = "".join(p.get("reasoning_content", "") for p in parts) or None
        if self.calls:
            # a whole message's calls have no `index` (only stream deltas do)
            msg["tool_calls"] = [
                {k: v for k, v in self.calls[i].items() if k != "index"} for i in sorted(self.calls)
            ]
        return msg

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason
