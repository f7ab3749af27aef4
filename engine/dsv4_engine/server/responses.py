"""OpenAI's Responses API: `POST /v1/responses` (streamed or not), `GET` and `DELETE
/v1/responses/{id}`.

A Responses request is served as the chat request it amounts to: `instructions` become the system
message, the input items the conversation (a `function_call_output` a tool message; `reasoning`,
assistant `message` and `function_call` items in a row one assistant turn), function tools and
`tool_choice` chat's, `text.format` chat's `response_format`, `reasoning.effort` chat's
`reasoning_effort` (DeepSeek-V4's thinking levels, server/reasoning.py). That chat request runs
through the chat route's own path (`start_chat`: template, grammar, sampling), and its output,
parsed by the chat route's parsers (`ChatOutput`: reasoning, DSML tool calls), becomes output items
in the order the model wrote them (`response_builder.ResponseBuilder`): `reasoning` (its text in `content`, as vLLM returns it), `message`,
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
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass
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
from dsv4_engine.server.response_builder import ResponseBuilder
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
