"""A Responses API response built from a chat generation: chat deltas (`ChatOutput`'s fields) in,
output items and their stream events out, in the documented order (server/responses.py serves them)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dsv4_engine.server.generation import Outcome
from dsv4_engine.server.responses_protocol import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Open:
    """The output item being written: its index, kind and text so far."""

    index: int
    kind: str  # reasoning | message | function_call
    item: dict[str, Any]
    text: str = ""


@dataclass
class ResponseBuilder:
    """Chat deltas (`ChatOutput`'s fields) in, output items and their stream events out."""

    req: ResponsesRequest
    model: str
    prompt_tokens: int
    id: str = field(default_factory=lambda: _id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))
    items: list[dict[str, Any]] = field(default_factory=list)
    open: _Open | None = None
    calls: dict[int, _Open] = field(default_factory=dict)  # chat call index -> its item
    seq: int = 0
    status: str = "in_progress"
    cut: bool = False  # max_output_tokens ended it
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0

    def _event(self, kind: str, **body: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **body}

    def start(self) -> list[dict[str, Any]]:
        body = self.response("in_progress")
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def _close(self) -> list[dict[str, Any]]:
        o, self.open = self.open, None
        if o is None:
            return []
        where = {"item_id": o.item["id"], "output_index": o.index}
        events = []
        if o.kind == "reasoning":
            part = {"type": "reasoning_text", "text": o.text}
            o.item["content"] = [part]
            events += [
                self._event("response.reasoning_text.done", **where, content_index=0, text=o.text),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        elif o.kind == "message":
            part = {"type": "output_text", "text": o.text, "annotations": [], "logprobs": []}
            o.item["content"] = [part]
            events += [
                self._event("response.output_text.done", **where, content_index=0, text=o.text, logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            o.item["arguments"] = o.text
            events.append(
                self._event(
                    "response.function_call_arguments.done", **where, name=o.item["name"], arguments=o.text
                )
            )
        o.item["status"] = "completed"
        return [*events, self._event("response.output_item.done", output_index=o.index, item=o.item)]

    def _begin(self, kind: str, item: dict[str, Any], part: dict[str, Any] | None) -> list[dict[str, Any]]:
        events = self._close()
        self.open = _Open(len(self.items), kind, item)
        self.items.append(item)
        events.append(
            self._event("response.output_item.added", output_index=self.open.index, item=dict(item))
        )
        if part is not None:
            where = {"item_id": item["id"], "output_index": self.open.index, "content_index": 0}
            events.append(self._event("response.content_part.added", **where, part=part))
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open is None or self.open.kind != kind:
            if kind == "reasoning":
                item = {
                    "type": "reasoning",
                    "id": _id("rs"),
                    "summary": [],
                    "content": [],
                    "status": "in_progress",
                }
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
                        "content": []}  # fmt: skip
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._begin(kind, item, part)
        assert self.open is not None
        self.open.text += text
        where = {"item_id": self.open.item["id"], "output_index": self.open.index, "content_index": 0}
        if kind == "reasoning":
            return [*events, self._event("response.reasoning_text.delta", **where, delta=text)]
        return [*events, self._event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta (`reasoning_content`, `content`, `tool_calls`), in its order."""
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", []):
            fn = call["function"]
            if call.get("id") is not None:  # a new call: its name (and maybe arguments so far)
                item = {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": fn["name"],
                        "arguments": "", "status": "in_progress"}  # fmt: skip
                events += self._begin("function_call", item, None)
                self.calls[call["index"]] = self.open  # type: ignore[assignment]
            target = self.calls[call["index"]]
            if fn.get("arguments"):
                assert target is self.open, "a call's arguments come before the next item starts"
                target.text += fn["arguments"]
                where = {"item_id": target.item["id"], "output_index": target.index}
                events.append(
                    self._event("response.function_call_arguments.delta", **where, delta=fn["arguments"])
                )
        return events

    def finish(self, out: Outcome) -> list[dict[str, Any]]:
        """Close the last item; the closing event with the whole response."""
        events = self._close()
        self.output_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.status = "completed" if out.finish_reason == "stop" else "incomplete"
        self.cut = out.finish_reason == "length"
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.response(self.status))]

    def response(self, status: str) -> dict[str, Any]:
        req = self.req
        done = status != "in_progress"
        usage = None
        if done:
            usage = {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": min(self.reasoning_tokens, self.output_tokens)},
                "total_tokens": self.prompt_tokens + self.output_tokens,
            }
        fmt = (
            req.text.format.model_dump(by_alias=True, exclude_none=True)
            if req.text and req.text.format
            else None
        )
        choice = req.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.cut else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": self.items if done else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "service_tier": "default",
            "store": req.stored(),
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else choice or "auto",
            "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools or []],
            "top_logprobs": 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
            "prompt_cache_key": req.prompt_cache_key,
            "safety_identifier": req.safety_identifier,
        }  # fmt: skip
