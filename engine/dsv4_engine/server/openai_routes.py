"""POST /v1/completions and /v1/chat/completions, streaming (SSE) and not."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from dsv4_engine.server.call import Call, Streams, gen_spec
from dsv4_engine.server.chat_output import ChatOutput
from dsv4_engine.server.errors import bad_request
from dsv4_engine.server.generation import GenSpec, Outcome, Piece, check_token_ids, prepare_sequences
from dsv4_engine.server.logprobs import (
    CompletionLogprobs,
    chat_content,
    chat_logprobs,
    merge_parts,
    token_text,
)
from dsv4_engine.server.prompts import encode_chat, encode_prompt
from dsv4_engine.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from dsv4_engine.server.state import ServerContext
from dsv4_engine.server.streaming import merge, sse
from dsv4_engine.server.structured import after_thinking, chat_grammar, control_tokens

router = APIRouter()

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def spec_from(ctx: ServerContext, req: SamplingRequest) -> GenSpec:
    if req.seed is not None and req.sampling_seed is not None and req.seed != req.sampling_seed:
        raise bad_request("seed and sampling_seed disagree; give one", "sampling_seed")
    seed = req.seed if req.seed is not None else req.sampling_seed
    spec = gen_spec(ctx, req, seed=seed, min_tokens=req.min_tokens)
    # vLLM's extensions that only its bodies (and so the OpenAI ones here) carry
    spec.include_stop_str = bool(req.include_stop_str_in_output)
    if req.bad_words:
        spec.bad_words = bad_word_ids(ctx.tokenizer, req.bad_words)
    if req.allowed_token_ids is not None:
        check_token_ids(ctx, req.allowed_token_ids, "allowed_token_ids")
        spec.allowed_token_ids = list(req.allowed_token_ids)
    return spec


def bad_word_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word's tokens as written, and as they are after a space (a word inside a
    sentence usually starts with one) when that spelling starts with another token."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and spaced[0] != plain[0]:
            out.append(spaced)
    return out


def usage(prompts: list[list[int]], outs: list[Outcome]) -> dict[str, Any]:
    """Each prompt counted once, however many choices it has (as OpenAI counts n > 1)."""
    prompt = sum(len(p) for p in prompts)
    completion = sum(o.completion_tokens for o in outs)
    cached = cached_tokens([o.cached_tokens for o in outs], len(prompts))
    return usage_body(prompt, completion, cached)


def usage_body(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},  # vLLM's place for it
    }


def cached_tokens(per_choice: list[int], prompts: int) -> int:
    """usage's cached_tokens, counted as prompt_tokens is: each prompt once, at the fewest of its n
    choices (choice i is prompt i // n), since the prompt tokens some choice computed were not cached."""
    n = len(per_choice) // prompts if prompts else 0
    return sum(min(per_choice[p * n : (p + 1) * n], default=0) for p in range(prompts))


@router.post("/v1/completions", response_model=None)
async def completions(req: CompletionRequest, request: Request) -> Response:
    call = Call.begin(request, req, "completion")
    ctx = call.ctx
    n = req.n or 1
    texts = req.prompts()
    prompts = [await encode_prompt(ctx, p) for p in texts]
    requested = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    spec = spec_from(ctx, req)
    spec.logprobs = req.logprobs
    if req.echo and req.logprobs is not None:
        spec.prompt_logprobs = req.logprobs  # only these requests pay for every prompt row's logits
    if requested == 0:
        # OpenAI's (and lm-eval's) "score the prompt": the prompt is the whole answer. The engine
        # makes one token anyway (no extra forward: it comes from the prefill's last row) and it is
        # dropped, as vLLM does.
        if not req.echo:
            raise bad_request("max_tokens 0 is only allowed with echo: true", "max_tokens")
        if spec.min_tokens:
            raise bad_request("min_tokens must be 0 when max_tokens is 0", "min_tokens")
        spec.hide_output = True
    seqs, params = prepare_sequences(ctx, spec, prompts, max(requested, 1), n, "prompt", "max_tokens")
    echoes = [(p if isinstance(p, str) else ctx.tokenizer.decode(p)) if req.echo else "" for p in texts]
    streams = await call.start(req, spec, seqs, params, n)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    shape = _Choices(ctx, req, prompts, echoes, n)
    if req.stream:
        return call.stream(_stream_completion(call, req, streams, rid, created, shape))
    outs = await call.collect(streams)
    choices = [
        {
            "index": i,
            "text": shape.echo(i) + o.text,
            "logprobs": shape.whole(i, o),
            "finish_reason": o.finish_reason,
            "matched_stop": o.matched_stop,
        }
        for i, o in enumerate(outs)
    ]
    body = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(prompts, outs),
    }
    return JSONResponse(body)


class _Choices:
    """Completion choice i = prompt i // n: its echo and its `logprobs`, whole or chunk by chunk."""

    def __init__(
        self, ctx: ServerContext, req: CompletionRequest, prompts: list[list[int]], echoes: list[str], n: int
    ) -> None:
        self.req, self.prompts, self.echoes, self.n = req, prompts, echoes, n
        self.words = token_text(ctx.tokenizer) if req.logprobs is not None else None
        self.logprobs: dict[int, CompletionLogprobs] = {}

    def echo(self, i: int) -> str:
        return self.echoes[i // self.n]

    def _acc(self, i: int) -> CompletionLogprobs:
        assert self.words is not None and self.req.logprobs is not None
        return self.logprobs.setdefault(i, CompletionLogprobs(self.words, self.req.logprobs))

    def prompt_part(self, i: int, item: Piece | Outcome) -> dict[str, list[Any]] | None:
        if self.words is None or not self.req.echo:
            return None
        return self._acc(i).part(item.prompt_logprobs, self.prompts[i // self.n])

    def part(self, i: int, entries: list[Any] | None, token_ids: list[int]) -> dict[str, list[Any]] | None:
        return None if self.words is None else self._acc(i).part(entries, token_ids)

    def whole(self, i: int, out: Outcome) -> dict[str, list[Any]] | None:
        if self.words is None:
            return None
        parts = [p for p in (self.prompt_part(i, out), self.part(i, out.logprobs, out.token_ids)) if p]
        return merge_parts(*parts)


class _Usage:
    """Token counts of a streamed response so far: each prompt once, completions per choice."""

    def __init__(self, prompts: list[list[int]], choices: int) -> None:
        self.prompts = len(prompts)
        self.prompt = sum(len(p) for p in prompts)
        self.completion = [0] * choices
        self.cached = [0] * choices  # known from a choice's first piece on

    def add(self, index: int, item: Piece | Outcome) -> None:
        self.cached[index] = item.cached_tokens
        if isinstance(item, Piece):
            self.completion[index] += len(item.token_ids)
        else:
            self.completion[index] = item.completion_tokens

    def body(self) -> dict[str, Any]:
        return usage_body(self.prompt, sum(self.completion), cached_tokens(self.cached, self.prompts))


def _chunk_usage(req: SamplingRequest, progress: _Usage) -> dict[str, Any]:
    if req.continuous_usage():
        return {"usage": progress.body()}
    return {"usage": None} if req.include_usage() else {}


class _Held:
    """Per choice, the logprobs of tokens whose text has not been sent yet (a piece whose text is
    still held back, e.g. half a character, carries none); they go out with the next text chunk, and
    what is left with the finishing chunk, so the chunks' logprobs together cover every token."""

    def __init__(self, choices: int) -> None:
        self.entries: list[list[Any]] = [[] for _ in range(choices)]
        self.ids: list[list[int]] = [[] for _ in range(choices)]
        self.sent = [0] * choices

    def add(self, i: int, piece: Piece) -> None:
        self.entries[i] += piece.logprobs or []
        self.ids[i] += piece.token_ids if piece.logprobs else []

    def take(self, i: int) -> tuple[list[Any], list[int]]:
        entries, ids = self.entries[i], self.ids[i]
        self.entries[i], self.ids[i] = [], []
        self.sent[i] += len(entries)
        return entries, ids

    def rest(self, i: int, out: Outcome) -> tuple[list[Any], list[int]]:
        entries = (out.logprobs or [])[self.sent[i] :]
        self.sent[i] += len(entries)
        return entries, out.token_ids[len(out.token_ids) - len(entries) :]


async def _stream_completion(
    call: Call, req: CompletionRequest, streams: Streams, rid: str, created: int, shape: _Choices
) -> AsyncGenerator[bytes, None]:
    progress = _Usage(shape.prompts, len(streams))
    every_piece = req.continuous_usage()  # then empty pieces are sent too: each carries token counts
    head = {"id": rid, "object": "text_completion", "created": created, "model": call.ctx.model_name}
    # With logprobs the echo waits for the prompt's logprobs, which come with the first output.
    echo_late = bool(req.echo) and req.logprobs is not None
    echoed = [False] * len(streams)
    held = _Held(len(streams))

    def chunk(i: int, text: str, reason: str | None, logprobs: dict[str, Any] | None = None) -> bytes:
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return sse({**head, "choices": [choice], **_chunk_usage(req, progress)})

    for i in range(len(streams)):
        if shape.echo(i) and not echo_late:
            yield chunk(i, shape.echo(i), None)
    async with contextlib.aclosing(merge(streams)) as merged:
        async for i, item in merged:
            progress.add(i, item)
            if echo_late and not echoed[i]:
                echoed[i] = True
                yield chunk(i, shape.echo(i), None, shape.prompt_part(i, item))
            if isinstance(item, Piece):
                held.add(i, item)
                if item.text or every_piece:
                    yield chunk(i, item.text, None, shape.part(i, *held.take(i)))
            else:
                call.finished(item)
                entries, ids = held.rest(i, item)
                yield chunk(i, "", item.finish_reason, shape.part(i, entries, ids) if entries else None)
    if req.include_usage():
        yield sse({**head, "choices": [], "usage": progress.body()})


async def start_chat(call: Call, req: ChatCompletionRequest) -> tuple[Streams, list[int], GenSpec]:
    """A chat request's sequences started (n of them): their streams, the prompt's ids, the spec.
    /v1/responses starts its chat request here too."""
    ctx = call.ctx
    ids = await encode_chat(ctx, req)
    limit = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    spec = spec_from(ctx, req)
    if req.logprobs:
        spec.logprobs = req.top_logprobs or 0
    controls = control_tokens(ctx.tokenizer)
    chat = chat_grammar(req, controls)  # with thinking on, already after the reasoning
    if chat and spec.grammar:
        raise bad_request(
            "give response_format/tool_choice or a constraint field (json_schema, regex, guided_*, "
            "structured_outputs), not both",
            "response_format",
        )
    if spec.grammar and req.thinking():  # a constraint field's grammar constrains the answer too
        spec.grammar = after_thinking(spec.grammar, controls)
    spec.grammar = chat or spec.grammar
    n = req.n or 1
    seqs, params = prepare_sequences(ctx, spec, [ids], req.token_limit(), n, "messages", limit)
    return await call.start(req, spec, seqs, params, n), ids, spec


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    call = Call.begin(request, req, "chat")
    ctx = call.ctx
    streams, ids, spec = await start_chat(call, req)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if req.stream:
        return call.stream(_stream_chat(call, req, streams, rid, created, [ids]))
    outs = await call.collect(streams)
    words = token_text(ctx.tokenizer) if req.logprobs else None
    shaped = [ChatOutput(req) for _ in outs]
    choices = [
        {
            "index": i,
            "message": shaped[i].message(out.text),
            "logprobs": None
            if words is None
            else chat_logprobs(out.logprobs or [], spec.logprobs or 0, words),
            "finish_reason": shaped[i].finish_reason(out.finish_reason),
            "matched_stop": out.matched_stop,
        }
        for i, out in enumerate(outs)
    ]
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage([ids], outs),
    }
    return JSONResponse(body)


async def _stream_chat(
    call: Call, req: ChatCompletionRequest, streams: Streams, rid: str, created: int, prompts: list[list[int]]
) -> AsyncGenerator[bytes, None]:
    progress = _Usage(prompts, len(streams))
    every_piece = req.continuous_usage()
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": call.ctx.model_name}
    words = token_text(call.ctx.tokenizer) if req.logprobs else None
    top = req.top_logprobs or 0
    held = _Held(len(streams))

    def chunk(i: int, delta: dict[str, Any], reason: str | None, entries: list[Any] | None = None) -> bytes:
        logprobs = None
        if words is not None and entries:
            logprobs = {"content": chat_content(entries, top, words), "refusal": None}
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return sse({**head, "choices": [choice], **_chunk_usage(req, progress)})

    shaped = [ChatOutput(req) for _ in streams]
    for i in range(len(streams)):
        yield chunk(i, {"role": "assistant", "content": ""}, None)
    async with contextlib.aclosing(merge(streams)) as merged:
        async for i, item in merged:
            progress.add(i, item)
            if isinstance(item, Piece):
                held.add(i, item)
                delta = shaped[i].delta(item.text) if shaped[i].active else {"content": item.text}
                if (item.text and delta) or every_piece:
                    yield chunk(i, delta, None, held.take(i)[0])
                continue
            call.finished(item)
            if rest := shaped[i].finish():
                yield chunk(i, rest, None)
            yield chunk(i, {}, shaped[i].finish_reason(item.finish_reason), held.rest(i, item)[0])
    if req.include_usage():
        yield sse({**head, "choices": [], "usage": progress.body()})
