"""DeepSeek-V4's tool calls (DSML, as SGLang's `deepseekv4` detector reads them) to OpenAI `tool_calls`.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

An invoke's body is parameter tags (string="true": the value as written; "false": JSON) or one JSON
object. `ToolCallParser` is incremental: text in, in chunks cut anywhere, content and call deltas out
(a call's name as soon as its invoke tag is complete, its arguments when the invoke closes), never
holding back more than a possible partial tag. What is not a well-formed call stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from dsv4_engine.tokenizer import DSML

BLOCK_START = f"<{DSML}tool_calls>"
BLOCK_END = f"</{DSML}tool_calls>"
INVOKE_PREFIX = f'<{DSML}invoke name="'
INVOKE_END = f"</{DSML}invoke>"
_PARAM = re.compile(
    rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.DOTALL
)


def invoke_start(name: str) -> str:
    return f'{INVOKE_PREFIX}{name}">\n'


@dataclass
class CallDelta:
    """One piece of call `index`: its id and name (first), or its arguments (a JSON object's text)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def openai(self) -> dict[str, object]:
        if self.name is not None:
            fn: dict[str, object] = {"name": self.name, "arguments": self.arguments or ""}
            return {"index": self.index, "id": self.id, "type": "function", "function": fn}
        return {"index": self.index, "function": {"arguments": self.arguments or ""}}


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def parse_arguments(body: str) -> str:
    """An invoke's body as a JSON object's text; ValueError if it is neither form."""
    body = body.strip()
    if body.startswith("{"):
        value = json.loads(body)
        if not isinstance(value, dict):
            raise ValueError("arguments must be a JSON object")
        return json.dumps(value, ensure_ascii=False)
    args: dict[str, object] = {}
    end = 0
    for m in _PARAM.finditer(body):
        if body[end : m.start()].strip():
            raise ValueError("text between parameters")
        name, is_string, value = m.groups()
        args[name] = value if is_string == "true" else json.loads(value)
        end = m.end()
    if body[end:].strip():
        raise ValueError("text after the last parameter")
    return json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    def __init__(self) -> None:
        self.buf = ""
        self.state = "content"  # content | block | invoke
        self.calls = 0  # calls started

    def push(self, text: str) -> Parsed:
        self.buf += text
        out = Parsed()
        while True:
            if self.state == "content":
                i = self.buf.find(BLOCK_START)
                if i < 0:
                    hold = _partial_suffix(self.buf, BLOCK_START)
                    cut = len(self.buf) - hold
                    # trailing newlines may be the "\n\n" in front of a block: hold them too
                    cut = len(self.buf[:cut].rstrip("\n")) if hold or self.buf[:cut].endswith("\n") else cut
                    out.content += self.buf[:cut]
                    self.buf = self.buf[cut:]
                    return out
                out.content += self.buf[:i].rstrip("\n")
                self.buf = self.buf[i + len(BLOCK_START) :]
                self.state = "block"
            elif self.state == "block":
                rest = self.buf.lstrip()
                if rest.startswith(BLOCK_END):
                    self.buf = rest[len(BLOCK_END) :]
                    self.state = "content"
                    continue
                if rest.startswith(INVOKE_PREFIX):
                    close = rest.find('">', len(INVOKE_PREFIX))
                    if close < 0:
                        self.buf = rest
                        return out
                    name = rest[len(INVOKE_PREFIX) : close]
                    out.calls.append(CallDelta(self.calls, f"call_{uuid.uuid4().hex[:24]}", name, ""))
                    self.calls += 1
                    self.buf = rest[close + 2 :]
                    self.state = "invoke"
                    continue
                if not rest or BLOCK_END.startswith(rest) or INVOKE_PREFIX.startswith(rest):
                    self.buf = rest
                    return out
                out.content += rest  # not DSML after all: keep it as text
                self.buf = ""
                self.state = "content"
            else:
                i = self.buf.find(INVOKE_END)
                if i < 0:
                    return out
                body, self.buf = self.buf[:i], self.buf[i + len(INVOKE_END) :]
                try:
                    args = parse_arguments(body)
                except ValueError:
                    args = body.strip()  # malformed: the client sees what the model wrote
                out.calls.append(CallDelta(self.calls - 1, arguments=args))
                self.state = "block"

    def finish(self) -> Parsed:
        """The end of the output: what is still held. A call cut short (max_tokens) gets the raw
        arguments written so far."""
        out = Parsed()
        if self.state == "invoke":
            out.calls.append(CallDelta(self.calls - 1, arguments=self.buf.strip()))
        elif self.state == "content":
            out.content = self.buf
        self.buf = ""
        return out


def parse_all(text: str) -> tuple[str, list[dict[str, object]]]:
    """Whole-output parsing: (content, OpenAI tool_calls)."""
    parser = ToolCallParser()
    first, last = parser.push(text), parser.finish()
    calls: dict[int, dict[str, object]] = {}
    for d in first.calls + last.calls:
        if d.name is not None:
            calls[d.index] = d.openai()
        else:
            fn = calls[d.index]["function"]
            fn["arguments"] += d.arguments or ""  # type: ignore[index,operator]
    return first.content + last.content, [calls[i] for i in sorted(calls)]
