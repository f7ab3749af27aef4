"""What the generation routes (/v1/completions, /v1/chat/completions, /generate) share: the checks a
request passes first, its GenSpec from the sampling fields, starting its sequences, and answering
(the outcomes collected, or an SSE stream ended by `[DONE]`).

`Call.begin` is every route's prologue, in one order: the fields the server ignored are reported
first (so an error answer carries `x-dsv4-ignored-fields` too), then admission (503 while loading,
draining, dead or full; on a PD server a refusal also ends the rooms the request names), the model
name (404) and the PD fields (400 on a colocated server).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.server import pd
from dsv4_engine.server.errors import ApiError, bad_request
from dsv4_engine.server.generation import (
    GenSpec,
    Lease,
    Outcome,
    Piece,
    admit,
    check_token_ids,
    outcomes,
    start_all,
)
from dsv4_engine.server.middleware import IGNORED_FIELDS_STATE, field_list
from dsv4_engine.server.native_protocol import GenerateRequest, GenerateSamplingParams
from dsv4_engine.server.protocol import SamplingRequest
from dsv4_engine.server.state import ServerContext
from dsv4_engine.server.streaming import DONE, merge, sse, sse_response, unless_disconnected
from dsv4_engine.server.structured import constraint_grammar
from dsv4_engine.server.validation import RequestBody, logit_bias_ids, stop_list

log = logging.getLogger("dsv4.server")

_PD_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key")

Streams = list[AsyncIterator[Piece | Outcome]]


def context(request: Request) -> ServerContext:
    return request.app.state.ctx


def report_ignored(request: Request, req: RequestBody) -> None:
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
    given = [f for f in _PD_FIELDS if getattr(req, f) is not None]
    if given and ctx.settings.disaggregation_mode == "null":
        raise bad_request(
            f"'{given[0]}' is only accepted by a prefill or decode server; this one runs with "
            "--disaggregation-mode null",
            given[0],
            "unsupported_parameter",
        )


def gen_spec(
    ctx: ServerContext,
    fields: SamplingRequest | GenerateSamplingParams,
    *,
    seed: int | None,
    min_tokens: int | None,
    prefix: str = "",
) -> GenSpec:
    """The sampling fields the OpenAI bodies and /generate's `sampling_params` share, as a GenSpec;
    `prefix` is where they sit in the body (for the errors' `param`)."""
    bias = logit_bias_ids(fields.logit_bias)
    if bias:
        check_token_ids(ctx, bias, f"{prefix}logit_bias")
    return GenSpec(
        temperature=1.0 if fields.temperature is None else fields.temperature,
        top_p=1.0 if fields.top_p is None else fields.top_p,
        top_k=-1 if fields.top_k is None else fields.top_k,
        ignore_eos=bool(fields.ignore_eos),
        seed=seed,
        stop=stop_list(fields.stop),
        stop_token_ids=list(fields.stop_token_ids or []),
        skip_special_tokens=True if fields.skip_special_tokens is None else fields.skip_special_tokens,
        presence_penalty=fields.presence_penalty or 0.0,
        frequency_penalty=fields.frequency_penalty or 0.0,
        repetition_penalty=1.0 if fields.repetition_penalty is None else fields.repetition_penalty,
        min_p=fields.min_p or 0.0,
        min_tokens=min_tokens or 0,
        logit_bias=bias,
        grammar=constraint_grammar(fields, prefix),
    )


@dataclass
class Call:
    """One generation request on its way through a route: begun (checked), started (its sequences
    handed to the engine under one lease), answered."""

    ctx: ServerContext
    request: Request
    kind: str  # "completion", "chat" or "generate": what its log lines start with
    arrival: float
    metrics: bool = True  # /generate's `log_metrics: false` (probes) keeps it out of the metrics
    logs: bool = True  # /generate's `no_logs`
    lease: Lease | None = field(default=None, init=False)

    @classmethod
    def begin(
        cls,
        request: Request,
        req: SamplingRequest | GenerateRequest,
        kind: str,
        *,
        metrics: bool = True,
        logs: bool = True,
    ) -> Call:
        arrival = time.monotonic()
        report_ignored(request, req)
        ctx = context(request)
        pd.check_admission(ctx, req)
        ctx.require_model(req.model)
        check_pd_fields(ctx, req)
        return cls(ctx, request, kind, arrival, metrics, logs)

    async def start(
        self,
        req: SamplingRequest | GenerateRequest,
        spec: GenSpec,
        seqs: list[list[int]],
        params: list[SamplingParams],
        n: int,
    ) -> Streams:
        """Hand every sequence (n per prompt, prompt-major) to the engine, or on a PD server to its
        half of the protocol; one stream of pieces and an outcome per sequence. With
        --prefix-cache-peers, first fetch what a peer's cache holds of each prompt beyond this
        server's (the request is in flight meanwhile, so a drain waits for it) and queue its import
        just ahead of the sequences."""
        ctx = self.ctx
        targets = pd.targets(ctx, req, len(seqs) // n, n)
        admitted = None
        if ctx.peers is not None:
            admitted = admit(ctx, len(seqs), targets)
            try:
                records = await ctx.peers.fetch(seqs[::n])
            except BaseException:  # cancelled: the client left before its request started
                admitted()
                if targets:
                    pd.abort_rooms(ctx, targets, "cancelled", "the request ended before it started")
                raise
            ctx.peers.cache(records)  # ahead of the sequences, with no await between
        self.lease = start_all(
            ctx, seqs, params, arrival=self.arrival, observe=self.metrics, targets=targets, admitted=admitted
        )
        return [outcomes(ctx, h, spec) for h in self.lease.handles]

    def finished(self, out: Outcome) -> None:
        """Per-request metrics and one log line (x-request-id included, never the prompt)."""
        e2e = time.monotonic() - self.arrival
        if self.metrics:
            self.ctx.metrics.e2e.observe(e2e)
            self.ctx.metrics.finished.labels(out.finish_reason).inc()
        if not self.logs:
            return
        ttft = "-" if out.ttft is None else f"{out.ttft * 1000:.1f}ms"
        log.info(
            "%s done x-request-id=%s prompt_tokens=%d completion_tokens=%d finish=%s ttft=%s e2e=%.1fms",
            self.kind,
            getattr(self.request.state, "request_id", "-"),
            out.prompt_tokens,
            out.completion_tokens,
            out.finish_reason,
            ttft,
            e2e * 1000,
        )

    async def collect(self, streams: Streams) -> list[Outcome]:
        """Every sequence's outcome, in order. A client that leaves first raises ClientGone (answered
        499), which aborts the sequences."""
        assert self.lease is not None

        async def gather() -> list[Outcome]:
            results: list[Outcome | None] = [None] * len(streams)
            async for i, item in merge(streams):
                if isinstance(item, Outcome):
                    results[i] = item
                    self.finished(item)
            return [r for r in results if r is not None]

        try:
            return await unless_disconnected(self.request, gather)
        finally:
            self.lease.close()

    def stream(
        self,
        events: AsyncGenerator[bytes, None],
        *,
        end: bytes = DONE,
        error: Callable[[ApiError], bytes] = lambda err: sse(err.body()),
    ) -> StreamingResponse:
        """`events` as Server-Sent Events, then `end` (`[DONE]`; the Responses API sends nothing).
        Once the response has started an error is reported in-band (`error(err)`: chat's
        `data: {"error": ...}`), then `end`; the lease closes however it ends."""
        assert self.lease is not None
        body = _framed(events, self.lease, end, error)
        return sse_response(body, background=BackgroundTask(self.lease.close))


async def _framed(
    events: AsyncGenerator[bytes, None], lease: Lease, end: bytes, error: Callable[[ApiError], bytes]
) -> AsyncIterator[bytes]:
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
        yield end
    except ApiError as err:  # the response has started: report in-band, then end the stream
        yield error(err)
        yield end
    finally:
        lease.close()
