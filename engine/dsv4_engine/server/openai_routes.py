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
from dsv4_engine.server.errors import ApiError, bad_request
from dsv4_engine.server.generation import (
    GenSpec,
    Lease,
    Outcome,
    Piece,
    outcomes,
    resolve_max_tokens,
    sampling_params,
    start_all,
)
from dsv4_engine.server.middleware import IGNORED_FIELDS_STATE, field_list
from dsv4_engine.server.prompts import encode_chat, encode_prompt
from dsv4_engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _Request,
    _Sampling,
    stop_list,
)
from dsv4_engine.server.state import ServerContext
from dsv4_engine.server.streaming import DONE, ClientGone, merge, sse, sse_response, unless_disconnected

log = logging.getLogger("dsv4.server")
router = APIRouter()

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def spec_from(req: _Sampling) -> GenSpec:
    if req.seed is not None and req.sampling_seed is not None and req.seed != req.sampling_seed:
        raise bad_request("seed and sampling_seed disagree; give one", "sampling_seed")
    return GenSpec(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        ignore_eos=bool(req.ignore_eos),
        seed=req.seed if req.seed is not None else req.sampling_seed,
        stop=stop_list(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
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


def usage(outs: list[Outcome]) -> dict[str, int]:
    prompt = sum(o.prompt_tokens for o in outs)
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


def _prepare(
    ctx: ServerContext,
    spec: GenSpec,
    prompts: list[list[int]],
    requested: int | None,
    prompt: str,
    limit: str,
) -> list[Any]:
    return [
        sampling_params(
            spec, resolve_max_tokens(ctx, len(ids), requested, prompt_param=prompt, limit_param=limit)
        )
        for ids in prompts
    ]


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
    texts = req.prompts()
    prompts = [await encode_prompt(ctx, p) for p in texts]
    requested = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    spec = spec_from(req)
    params = _prepare(ctx, spec, prompts, requested, "prompt", "max_tokens")
    echoes = [(p if isinstance(p, str) else ctx.tokenizer.decode(p)) if req.echo else "" for p in texts]
    lease = start_all(ctx, prompts, params, arrival=arrival, targets=pd.targets(ctx, req, len(prompts)))
    streams = [outcomes(ctx, h, spec) for h in lease.handles]
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if req.stream:
        body = _stream_completion(ctx, request, req, streams, lease, rid, created, echoes, arrival)
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
            "text": echoes[i] + o.text,
            "logprobs": None,
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
        "usage": usage(outs),
    }
    return JSONResponse(body)


class _Usage:
    """Token counts of a streamed response so far, per choice."""

    def __init__(self, lease: Lease) -> None:
        self.prompt = sum(h.prompt_len for h in lease.handles)
        self.completion = [0] * len(lease.handles)

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


async def _stream_completion(
    ctx: ServerContext,
    request: Request,
    req: CompletionRequest,
    streams: list[AsyncIterator[Piece | Outcome]],
    lease: Lease,
    rid: str,
    created: int,
    echoes: list[str],
    arrival: float,
) -> AsyncIterator[bytes]:
    progress = _Usage(lease)
    every_piece = req.continuous_usage()  # then empty pieces are sent too: each carries token counts
    head = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}

    def chunk(i: int, text: str, reason: str | None) -> bytes:
        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
        return sse({**head, "choices": [choice], **_chunk_usage(req, progress)})

    try:
        for i, echo in enumerate(echoes):
            if echo:
                yield chunk(i, echo, None)
        async with contextlib.aclosing(merge(streams)) as merged:
            async for i, item in merged:
                progress.add(i, item)
                if isinstance(item, Piece):
                    if item.text or every_piece:
                        yield chunk(i, item.text, None)
                else:
                    finished(ctx, request, "completion", item, arrival)
                    yield chunk(i, "", item.finish_reason)
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
    ids = await encode_chat(ctx, req)
    limit = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    spec = spec_from(req)
    params = _prepare(ctx, spec, [ids], req.token_limit(), "messages", limit)
    lease = start_all(ctx, [ids], params, arrival=arrival, targets=pd.targets(ctx, req, 1))
    streams = [outcomes(ctx, h, spec) for h in lease.handles]
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if req.stream:
        body = _stream_chat(ctx, request, req, streams[0], lease, rid, created, arrival)
        return sse_response(body, background=BackgroundTask(lease.close))
    try:
        outs = await unless_disconnected(request, lambda: _collect(ctx, request, "chat", streams, arrival))
    except ClientGone:
        return Response(status_code=499)
    finally:
        lease.close()
    out = outs[0]
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": ctx.model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": None,
                "finish_reason": out.finish_reason,
                "matched_stop": out.matched_stop,
            }
        ],
        "usage": usage(outs),
    }
    return JSONResponse(body)


async def _stream_chat(
    ctx: ServerContext,
    request: Request,
    req: ChatCompletionRequest,
    stream: AsyncIterator[Piece | Outcome],
    lease: Lease,
    rid: str,
    created: int,
    arrival: float,
) -> AsyncIterator[bytes]:
    progress = _Usage(lease)
    every_piece = req.continuous_usage()
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}

    def chunk(delta: dict[str, Any], reason: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return sse({**head, "choices": [choice], **_chunk_usage(req, progress)})

    try:
        yield chunk({"role": "assistant", "content": ""}, None)
        async with contextlib.aclosing(stream) as items:
            async for item in items:
                progress.add(0, item)
                if isinstance(item, Piece):
                    if item.text or every_piece:
                        yield chunk({"content": item.text}, None)
                    continue
                finished(ctx, request, "chat", item, arrival)
                yield chunk({}, item.finish_reason)
        if req.include_usage():
            yield sse({**head, "choices": [], "usage": progress.body()})
        yield DONE
    except ApiError as err:
        yield sse(err.body())
        yield DONE
    finally:
        lease.close()
