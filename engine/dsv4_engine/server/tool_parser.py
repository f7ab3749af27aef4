"""DeepSeek-V4's tool calls (DSML, as SGLang's `deepseekv4` detector reads them) to OpenAI `tool_calls`.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

An invoke's body is parameter tags (string="true": the value as written; "false": JSON) or one JSON
object. `ToolCallParser` is incremental: text in, in chunks cut anywhere, content and call deltas out
(a call's name as soon as its invoke tag is complete, its arguments as they are written, in several
deltas, as vLLM's and SGLang's parsers stream them), never holding back more than a possible partial
tag. What is not a well-formed call stays content.
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
PARAM_PREFIX = f'<{DSML}parameter name="'
PARAM_END = f"</{DSML}parameter>"
_PARAM_OPEN = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">')


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


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """States: `content` (text outside a block), `block` (between invokes), `invoke` (inside one).
    An invoke's arguments stream as they are written: a JSON body as its text; parameter tags as the
    JSON object they make (key and opening quote when a tag opens, a string value's characters
    escaped as they come, any other value whole when its tag closes, the closing brace at the end)."""

    def __init__(self) -> None:
        self.buf = ""
        self.state = "content"  # content | block | invoke
        self.calls = 0  # calls started
        self.body = ""  # the current invoke's form: "" (not yet known) | json | params | value | raw
        self.params = 0  # parameters opened in the current invoke
        self.string = False  # the open parameter's value is a string (string="true")

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
                    self.state, self.body, self.params = "invoke", "", 0
                    continue
                if not rest or BLOCK_END.startswith(rest) or INVOKE_PREFIX.startswith(rest):
                    self.buf = rest
                    return out
                out.content += rest  # not DSML after all: keep it as text
                self.buf = ""
                self.state = "content"
            elif not self._invoke(out):
                return out

    def _args(self, out: Parsed, text: str) -> None:
        if text:
            out.calls.append(CallDelta(self.calls - 1, arguments=text))

    def _invoke(self, out: Parsed) -> bool:
        """Advance inside an invoke; False when more text is needed."""
        if self.body in ("", "params"):
            rest = self.buf.lstrip()
            if not rest:
                self.buf = ""
                return False
            if rest.startswith(INVOKE_END):
                self._args(out, "}" if self.params else "{}")
                self.buf, self.state = rest[len(INVOKE_END) :], "block"
                return True
            if self.body == "" and rest[0] == "{":
                self.buf, self.body = rest, "json"
                return True
            if m := _PARAM_OPEN.match(rest):
                name, is_string = m.groups()
                self.string = is_string == "true"
                head = ("{" if not self.params else ", ") + json.dumps(name, ensure_ascii=False) + ": "
                self._args(out, head + ('"' if self.string else ""))
                self.params += 1
                self.buf, self.body = rest[m.end() :], "value"
                return True
            if PARAM_PREFIX.startswith(rest[: len(PARAM_PREFIX)]) and ">" not in rest:
                self.buf = rest  # a parameter tag not yet whole
                return False
            if INVOKE_END.startswith(rest):
                self.buf = rest
                return False
            # neither form: the client gets what the model wrote after what was sent so far
            self.buf, self.body = rest, "raw"
            return True
        if self.body == "value":
            i = self.buf.find(PARAM_END)
            if i < 0:
                if not self.string:
                    return False  # a JSON value goes out whole, once its tag closes
                cut = len(self.buf) - _partial_suffix(self.buf, PARAM_END)
                self._args(out, _escaped(self.buf[:cut]))
                self.buf = self.buf[cut:]
                return False
            value, self.buf = self.buf[:i], self.buf[i + len(PARAM_END) :]
            self._args(out, _escaped(value) + '"' if self.string else _json_value(value))
            self.body = "params"
            return True
        # json or raw: the text as written, less trailing whitespace and a possible end tag
        i = self.buf.find(INVOKE_END)
        if i < 0:
            keep = _partial_suffix(self.buf, INVOKE_END)
            cut = len(self.buf[: len(self.buf) - keep].rstrip())
            self._args(out, self.buf[:cut])
            self.buf = self.buf[cut:]
            return False
        self._args(out, self.buf[:i].rstrip())
        self.buf, self.state = self.buf[i + len(INVOKE_END) :], "block"
        return True

    def finish(self) -> Parsed:
        """The end of the output: what is still held. A call cut short (max_tokens) keeps the
        arguments sent so far and gets what was held back of them."""
        out = Parsed()
        if self.state == "invoke":
            held = self.buf.strip()
            self._args(out, _escaped(held) if self.body == "value" and self.string else held)
        elif self.state == "content":
            out.content = self.buf
        self.buf = ""
        return out


def _escaped(text: str) -> str:
    """`text` as it reads inside a JSON string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _json_value(text: str) -> str:
    """A string="false" parameter's value as JSON (a value that is not JSON becomes a string)."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return json.dumps(text.strip(), ensure_ascii=False)


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
