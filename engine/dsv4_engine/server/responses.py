"""OpenAI's Responses API: `POST /v1/responses` (streamed or not), `GET` and `DELETE
/v1/responses/{id}`.

A Responses request is served as the chat request it amounts to: `instructions` become the system
message, the input items the conversation (a `function_call_output` a tool message; `reasoning`,
assistant `message` and `function_call` items in a row one assistant turn), function tools and
`tool_choice` chat's, `text.format` chat's `response_format`, `reasoning.effort` chat's
`reasoning_effort` (DeepSeek-V4's thinking levels, server/reasoning.py). That chat request runs
through the chat route's own path (`start_chat`: template, grammar, sampling), and its output,
parsed by the chat route's parsers (`ChatOutput`: reasoning, DSML tool calls), becomes output items
in the order the model wrote them: `reasoning` (its text in `content`, as vLLM returns it), `message`,
`function_call`. Streamed, each item is announced, filled by deltas and closed, in the documented
event order (`response.created`, `response.in_progress`, then per item `output_item.added`,
`content_part.added`, text deltas, `*.done`, `content_part.done`, `output_item.done`, and
`response.completed`, or `response.incomplete` when `max_output_tokens` cut it).

Stored responses (`store`, true by default as OpenAI's) are kept in this process's memory, the most
recent `MAX_STORED` within `MAX_STORED_BYTES`, for `previous_response_id` and `GET`; a restart forgets
them.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from dsv4_engine.server.call import Call, Streams
from dsv4_engine.server.chat_output import ChatOutput
from dsv4_engine.server.errors import ApiError, bad_request, from_validation_errors
from dsv4_engine.server.generation import Outcome, Piece
from dsv4_engine.server.openai_routes import start_chat
from dsv4_engine.server.protocol import ChatCompletionRequest
from dsv4_engine.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from dsv4_engine.server.streaming import merge
from dsv4_engine.tokenizer import END_THINK

router = APIRouter()

# Stored responses kept for previous_response_id and GET: at most this many, and at most this much JSON
# (their bodies and conversations); the oldest go first.
MAX_STORED = 1024
MAX_STORED_BYTES = 64 * 2**20


# ---- the request as a chat request ---------------------------------------------------------------
def _messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages; an assistant's reasoning, text and calls in a row are one turn."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    for item in items:
        if isinstance(item, ReasoningItem):
            t = assistant()
            t["reasoning_content"] = t.get("reasoning_content", "") + item.text()
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function"}
            call["function"] = {"name": item.name, "arguments": item.arguments}
            assistant().setdefault("tool_calls", []).append(call)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            assistant()["content"] += item.text()
        elif isinstance(item, FunctionCallOutputItem):
            turn = None
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            turn = None
            out.append({"role": item.role, "content": item.text()})
    return out


def _input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    return _messages(req.input)


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    if fmt.name is None or fmt.schema_ is None:
        raise bad_request("a json_schema format needs a name and a schema", "text.format")
    spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


# The fields a Responses body shares with chat's, passed on as they are.
_PASSED_ON = {
    "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
    "stop", "ignore_eos", "chat_template_kwargs", "user", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "bootstrap_pair_key",
}  # fmt: skip


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request `req` amounts to, after the conversation `history` (previous_response_id)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    choice: Any = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = [
        {"type": "function", "function": t.model_dump(include={"name", "description", "parameters", "strict"},
                                                      exclude_none=True)}
        for t in req.tools or []
    ]  # fmt: skip
    body = {
        "model": req.model,
        "messages": [*system, *history, *_input_messages(req)],
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req),
        "reasoning_effort": req.reasoning.effort if req.reasoning else None,
        **req.model_dump(include=_PASSED_ON),
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:  # what only the combination gets wrong (the items passed alone)
        raise from_validation_errors(list(exc.errors())) from exc


# ---- the output as items and events --------------------------------------------------------------
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
                "input_tokens_details": {"cached_tokens": 0},
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


# ---- what is kept --------------------------------------------------------------------------------
@dataclass
class _Stored:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # its input and output as chat messages, without instructions
    size: int = 0  # bytes of both as JSON

    def __post_init__(self) -> None:
        self.size = len(json.dumps([self.body, self.conversation], ensure_ascii=False).encode())


class ResponseStore:
    """The most recent stored responses, at most `limit` of them and `max_bytes` of JSON, in this
    process's memory."""

    def __init__(self, limit: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.limit, self.max_bytes = limit, max_bytes
        self.bytes = 0
        self._kept: OrderedDict[str, _Stored] = OrderedDict()

    def get(self, rid: str, param: str | None = None) -> _Stored:
        kept = self._kept.get(rid)
        if kept is None:
            raise ApiError(
                404,
                f"Response with id '{rid}' not found (responses are kept in memory, the {self.limit} "
                f"most recent within {self.max_bytes >> 20} MiB, and only with store: true)",
                param=param,
                code="response_not_found",
            )
        return kept

    def put(self, rid: str, kept: _Stored) -> None:
        self._kept[rid] = kept
        self.bytes += kept.size
        while len(self._kept) > self.limit or (self.bytes > self.max_bytes and len(self._kept) > 1):
            self.bytes -= self._kept.popitem(last=False)[1].size

    def delete(self, rid: str) -> None:
        self.bytes -= self.get(rid).size
        del self._kept[rid]


def store_of(request: Request) -> ResponseStore:
    state = request.app.state
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore()
    return state.responses


def _output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a next turn continues from."""
    parsed: list[Any] = []
    for item in items:
        if item["type"] == "reasoning":
            parsed.append(ReasoningItem.model_validate(item))
        elif item["type"] == "message":
            parsed.append(MessageItem(role="assistant", content=item["content"][0]["text"]))
        else:
            parsed.append(FunctionCallItem.model_validate({k: v for k, v in item.items() if k != "status"}))
    return _messages(parsed)


# ---- the routes ----------------------------------------------------------------------------------
def _sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def _error_event(err: ApiError) -> bytes:
    return _sse({"type": "error", "code": err.code, "message": err.message, "param": err.param})


@router.post("/v1/responses", response_model=None)
async def create_response(req: ResponsesRequest, request: Request) -> Response:
    call = Call.begin(request, req, "responses")
    store = store_of(request)
    history = (
        store.get(req.previous_response_id, "previous_response_id").conversation
        if req.previous_response_id
        else []
    )
    chat = chat_request(req, history)
    streams, ids, _ = await start_chat(call, chat)
    builder = ResponseBuilder(req, call.ctx.model_name, len(ids))

    def keep() -> None:
        if req.stored():
            conversation = [*history, *_input_messages(req), *_output_messages(builder.items)]
            store.put(builder.id, _Stored(builder.response(builder.status), conversation))

    if req.stream:
        return call.stream(_stream(call, chat, streams, builder, keep), end=b"", error=_error_event)
    (out,) = await call.collect(streams)
    shaped = ChatOutput(chat)
    builder.feed(shaped.delta(out.text))
    builder.feed(shaped.finish())
    builder.reasoning_tokens = _reasoning_tokens(call, out, shaped)
    builder.finish(out)
    keep()
    return JSONResponse(builder.response(builder.status))


def _reasoning_tokens(call: Call, out: Outcome, shaped: ChatOutput) -> int:
    """The tokens written before `</think>` (all of them if it never came)."""
    if shaped.reasoning is None:
        return 0
    text = call.ctx.tokenizer.decode(out.token_ids, skip_special_tokens=False)
    end = text.find(END_THINK)
    if end < 0:
        return out.completion_tokens
    return len(call.ctx.tokenizer.encode(text[:end], add_special_tokens=False))


async def _stream(
    call: Call, chat: ChatCompletionRequest, streams: Streams, builder: ResponseBuilder, keep: Any
) -> AsyncGenerator[bytes, None]:
    shaped = ChatOutput(chat)
    for event in builder.start():
        yield _sse(event)
    async with contextlib.aclosing(merge(streams)) as merged:
        async for _, item in merged:
            if isinstance(item, Piece):
                for event in builder.feed(shaped.delta(item.text)):
                    yield _sse(event)
                continue
            call.finished(item)
            events = builder.feed(shaped.finish())
            builder.reasoning_tokens = _reasoning_tokens(call, item, shaped)
            for event in [*events, *builder.finish(item)]:
                yield _sse(event)
            keep()


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> JSONResponse:
    return JSONResponse(store_of(request).get(response_id).body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    store_of(request).delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
