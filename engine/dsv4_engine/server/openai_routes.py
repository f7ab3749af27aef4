"""POST /v1/completions and /v1/chat/completions, streaming (SSE) and not."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from dsv4_engine.server import pd
from dsv4_engine.server.chat_output import ChatOutput
from dsv4_engine.server.errors import ApiError, bad_request
from dsv4_engine.server.generation import (
    GenSpec,
    Lease,
    Outcome,
    Piece,
    check_token_ids,
    outcomes,
    prepare_sequences,
    start_all,
)
from dsv4_engine.server.logprobs import (
    CompletionLogprobs,
    chat_content,
    chat_logprobs,
    merge_parts,
    token_text,
)
from dsv4_engine.server.middleware import IGNORED_FIELDS_STATE, field_list
from dsv4_engine.server.prompts import encode_chat, encode_prompt
from dsv4_engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _Request,
    _Sampling,
    logit_bias_ids,
    stop_list,
)
from dsv4_engine.server.state import ServerContext
from dsv4_engine.server.streaming import DONE, ClientGone, merge, sse, sse_response, unless_disconnected
from dsv4_engine.server.structured import chat_grammar, control_tokens, sglang_grammar

log = logging.getLogger("dsv4.server")
router = APIRouter()

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def spec_from(ctx: ServerContext, req: _Sampling) -> GenSpec:
    if req.seed is not None and req.sampling_seed is not None and req.seed != req.sampling_seed:
        raise bad_request("seed and sampling_seed disagree; give one", "sampling_seed")
    bias = logit_bias_ids(req.logit_bias)
    if bias:
        check_token_ids(ctx, bias, "logit_bias")
    return GenSpec(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        ignore_eos=bool(req.ignore_eos),
        seed=req.seed if req.seed is not None else req.sampling_seed,
        stop=stop_list(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        min_tokens=req.min_tokens or 0,
        logit_bias=bias,
        grammar=sglang_grammar(req.json_schema, req.regex),
    )


def report_ignored(request: Request, req: _Request) -> None:
    """One warning per request naming the unknown fields it carried; the middleware then answers
    with them in `x-dsv4-ignored-fields`. Call first, so that error answers carry the header too."""
    ignored = req.ignored_fields
    if not ignored:
        return
    setattr(request.state, IGNORED_FIELDS_STATE, ignored)
    log.warning(
        "%s: ignored request fields this server does not know: %s x-request-id=%s",
        request.url.path,
        field_list(ignored),
        getattr(request.state, "request_id", "-"),
    )


def check_pd_fields(ctx: ServerContext, req: Any) -> None:
    """PD bootstrap fields only make sense on a prefill or decode server."""
    given = [
        f
        for f in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key")
        if getattr(req, f) is not None
    ]
    if given and ctx.settings.disaggregation_mode == "null":
        raise bad_request(
            f"'{given[0]}' is only accepted by a prefill or decode server; this one runs with "
            "--disaggregation-mode null",
            given[0],
            "unsupported_parameter",
        )


def usage(prompts: list[list[int]], outs: list[Outcome]) -> dict[str, int]:
    """Each prompt counted once, however many choices it has (as OpenAI counts n > 1)."""
    prompt = sum(len(p) for p in prompts)
    completion = sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finished(
    ctx: ServerContext,
    request: Request,
    kind: str,
    out: Outcome,
    arrival: float,
    *,
    metrics: bool = True,
    logs: bool = True,
) -> None:
    """Per-request metrics and one log line (x-request-id included, never the prompt)."""
    e2e = time.monotonic() - arrival
    if metrics:
        ctx.metrics.e2e.observe(e2e)
        ctx.metrics.finished.labels(out.finish_reason).inc()
    if not logs:
        return
    ttft = "-" if out.ttft is None else f"{out.ttft * 1000:.1f}ms"
    log.info(
        "%s done x-request-id=%s prompt_tokens=%d completion_tokens=%d finish=%s ttft=%s e2e=%.1fms",
        kind,
        getattr(request.state, "request_id", "-"),
        out.prompt_tokens,
        out.completion_tokens,
        out.finish_reason,
        ttft,
        e2e * 1000,
    )


async def _collect(
    ctx: ServerContext,
    request: Request,
    kind: str,
    streams: list[AsyncIterator[Piece | Outcome]],
    arrival: float,
) -> list[Outcome]:
    results: list[Outcome | None] = [None] * len(streams)
    async for i, item in merge(streams):
        if isinstance(item, Outcome):
            results[i] = item
            finished(ctx, request, kind, item, arrival)
    return [r for r in results if r is not None]


@router.post("/v1/completions", response_model=None)
async def completions(req: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    report_ignored(request, req)
    ctx = _ctx(request)
    pd.check_admission(ctx, req)
    ctx.require_model(req.model)
    check_pd_fields(ctx, req)
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
    lease = start_all(ctx, seqs, params, arrival=arrival, targets=pd.targets(ctx, req, len(prompts), n))
    streams = [outcomes(ctx, h, spec) for h in lease.handles]
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    shape = _Choices(ctx, req, prompts, echoes, n)
    if req.stream:
        body = _stream_completion(ctx, request, req, streams, lease, rid, created, shape, arrival)
        return sse_response(body, background=BackgroundTask(lease.close))
    try:
        outs = await unless_disconnected(
            request, lambda: _collect(ctx, request, "completion", streams, arrival)
        )
    except ClientGone:
        return Response(status_code=499)
    finally:
        lease.close()
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
        self.prompt = sum(len(p) for p in prompts)
        self.completion = [0] * choices

    def add(self, index: int, item: Piece | Outcome) -> None:
        if isinstance(item, Piece):
            self.completion[index] += len(item.token_ids)
        else:
            self.completion[index] = item.completion_tokens

    def body(self) -> dict[str, int]:
        done = sum(self.completion)
        return {"prompt_tokens": self.prompt, "completion_tokens": done, "total_tokens": self.prompt + done}


def _chunk_usage(req: _Sampling, progress: _Usage) -> dict[str, Any]:
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
    ctx: ServerContext,
    request: Request,
    req: CompletionRequest,
    streams: list[AsyncIterator[Piece | Outcome]],
    lease: Lease,
    rid: str,
    created: int,
    shape: _Choices,
    arrival: float,
) -> AsyncIterator[bytes]:
    progress = _Usage(shape.prompts, len(streams))
    every_piece = req.continuous_usage()  # then empty pieces are sent too: each carries token counts
    head = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}
    # With logprobs the echo waits for the prompt's logprobs, which come with the first output.
    echo_late = bool(req.echo) and req.logprobs is not None
    echoed = [False] * len(streams)
    held = _Held(len(streams))

    def chunk(i: int, text: str, reason: str | None, logprobs: dict[str, Any] | None = None) -> bytes:
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return sse({**head, "choices": [choice], **_chunk_usage(req, progress)})

    try:
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
                    finished(ctx, request, "completion", item, arrival)
                    entries, ids = held.rest(i, item)
                    yield chunk(i, "", item.finish_reason, shape.part(i, entries, ids) if entries else None)
        if req.include_usage():
            yield sse({**head, "choices": [], "usage": progress.body()})
        yield DONE
    except ApiError as err:  # the response has started: report in-band, then end the stream
        yield sse(err.body())
        yield DONE
    finally:
        lease.close()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    report_ignored(request, req)
    ctx = _ctx(request)
    pd.check_admission(ctx, req)
    ctx.require_model(req.model)
    check_pd_fields(ctx, req)
    n = req.n or 1
    ids = await encode_chat(ctx, req)
    limit = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    spec = spec_from(ctx, req)
    if req.logprobs:
        spec.logprobs = req.top_logprobs or 0
    chat = chat_grammar(req, control_tokens(ctx.tokenizer))
    if chat and spec.grammar:
        raise bad_request("give response_format/tool_choice or json_schema/regex, not both", "json_schema")
    spec.grammar = chat or spec.grammar
    seqs, params = prepare_sequences(ctx, spec, [ids], req.token_limit(), n, "messages", limit)
    lease = start_all(ctx, seqs, params, arrival=arrival, targets=pd.targets(ctx, req, 1, n))
    streams = [outcomes(ctx, h, spec) for h in lease.handles]
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if req.stream:
        body = _stream_chat(ctx, request, req, streams, lease, rid, created, [ids], arrival)
        return sse_response(body, background=BackgroundTask(lease.close))
    try:
        outs = await unless_disconnected(request, lambda: _collect(ctx, request, "chat", streams, arrival))
    except ClientGone:
        return Response(status_code=499)
    finally:
        lease.close()
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
    ctx: ServerContext,
    request: Request,
    req: ChatCompletionRequest,
    streams: list[AsyncIterator[Piece | Outcome]],
    lease: Lease,
    rid: str,
    created: int,
    prompts: list[list[int]],
    arrival: float,
) -> AsyncIterator[bytes]:
    progress = _Usage(prompts, len(streams))
    every_piece = req.continuous_usage()
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
    words = token_text(ctx.tokenizer) if req.logprobs else None
    top = req.top_logprobs or 0
    held = _Held(len(streams))

    def chunk(i: int, delta: dict[str, Any], reason: str | None, entries: list[Any] | None = None) -> bytes:
        logprobs = None
        if words is not None and entries:
            logprobs = {"content": chat_content(entries, top, words), "refusal": None}
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return sse({**head, "choices": [choice], **_chunk_usage(req, progress)})

    shaped = [ChatOutput(req) for _ in streams]
    try:
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
                finished(ctx, request, "chat", item, arrival)
                if rest := shaped[i].finish():
                    yield chunk(i, rest, None)
                yield chunk(i, {}, shaped[i].finish_reason(item.finish_reason), held.rest(i, item)[0])
        if req.include_usage():
            yield sse({**head, "choices": [], "usage": progress.body()})
        yield DONE
    except ApiError as err:
        yield sse(err.body())
        yield DONE
    finally:
        lease.close()
