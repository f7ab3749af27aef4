"""What sglang-router 0.3.2 calls on a worker besides the OpenAI routes.

Registration: GET /health, then /server_info (falls back to /get_server_info on 404) and /model_info
(or /get_model_info). Runtime: GET /health every interval, /health_generate, /get_load (a list of
per-DP-rank loads whose `num_tokens` it sums), POST /flush_cache, and SGLang's native POST /generate.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from dsv4_engine import package_version
from dsv4_engine.server.call import Call, Streams, context, gen_spec
from dsv4_engine.server.errors import bad_request, unavailable
from dsv4_engine.server.generation import (
    GenSpec,
    Lease,
    Outcome,
    Piece,
    outcomes,
    prepare_sequences,
    sampling_params,
    start,
)
from dsv4_engine.server.logprobs import sglang_logprobs, token_text
from dsv4_engine.server.native_protocol import GenerateRequest
from dsv4_engine.server.prompts import encode_prompt
from dsv4_engine.server.state import ServerContext
from dsv4_engine.server.streaming import merge, sse

router = APIRouter()

GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
HEALTH_GENERATE_TIMEOUT = 20.0


def server_info(ctx: ServerContext) -> dict[str, Any]:
    from dsv4_engine.disagg.fingerprint import fingerprint_id

    s = ctx.settings
    snap = ctx.bridge.metrics() if ctx.bridge is not None else {}
    return {
        "model_path": s.model,
        "served_model_name": ctx.model_name,
        "tokenizer_path": s.model,
        "version": package_version(),
        "dtype": s.dtype,
        "device": s.device,
        "tp_size": s.tp_size,
        "ep_size": s.ep_size,
        "dp_size": 1,
        "disaggregation_mode": s.disaggregation_mode,
        "disaggregation_bootstrap_port": s.bootstrap_port,
        "disaggregation_transfer_backend": "mooncake",
        "disaggregation_transfer_protocol": s.transfer_protocol,
        "layout_fingerprint": ctx.fingerprint,
        "layout_fingerprint_id": fingerprint_id(ctx.fingerprint) if ctx.fingerprint else None,
        "pd_queues": ctx.pd.depths() if ctx.pd is not None else None,
        "page_size": s.page_size,
        "context_length": ctx.facts.max_model_len if ctx.facts else s.max_model_len,
        "chunked_prefill_size": s.chunked_prefill_size,
        "max_running_requests": s.max_num_seqs,
        "max_waiting": s.max_waiting,
        "status": ctx.phase.value,
        "internal_states": [
            {"num_running": snap.get("num_running", 0), "num_waiting": snap.get("num_waiting", 0)}
        ],
    }


def model_info(ctx: ServerContext) -> dict[str, Any]:
    facts = ctx.facts
    return {
        "model_path": ctx.settings.model,
        "tokenizer_path": ctx.settings.model,
        "served_model_name": ctx.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "model_type": facts.model_type if facts else None,
        "architectures": facts.architectures if facts else None,
        "max_context_length": facts.max_model_len if facts else None,
        "vocab_size": facts.vocab_size if facts else None,
        "eos_token_ids": facts.eos_token_ids if facts else None,
    }


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    return server_info(context(request))


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    ctx = context(request)
    if ctx.facts is None:
        raise unavailable("the model is still loading", retry_after=5, code="server_loading")
    return model_info(ctx)


@router.get("/get_load")
async def get_load(request: Request) -> list[dict[str, Any]]:
    ctx = context(request)
    snap = ctx.bridge.metrics() if ctx.bridge is not None else {}
    handles = ctx.bridge.open_handles() if ctx.bridge is not None else []
    waiting = ctx.bridge.waiting() if ctx.bridge is not None else 0
    return [
        {
            "dp_rank": 0,
            "num_reqs": int(snap.get("num_running", 0)) + waiting,
            "num_waiting_reqs": waiting,
            "num_tokens": sum(h.prompt_len + h.num_tokens for h in handles),
            "ts_tic": time.time(),
        }
    ]


@router.api_route("/flush_cache", methods=["GET", "POST"])  # SGLang takes both
async def flush_cache(request: Request) -> PlainTextResponse:
    """Empty the engine's prefix cache (pages running requests hold stay theirs)."""
    ctx = context(request)
    ctx.require_ready()
    await ctx.run_engine(lambda engine: engine.flush_cache())
    return PlainTextResponse("Cache flushed.\n")


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once one token went through the engine; 503 when not serving or the engine is stuck."""
    ctx = context(request)
    ctx.require_ready()
    arrival = time.monotonic()
    ids = [ctx.facts.eos_token_ids[0] if ctx.facts and ctx.facts.eos_token_ids else 0]
    spec = GenSpec(temperature=0.0)
    release = ctx.enter()
    lease = Lease(ctx, [], release)
    try:
        handle = start(ctx, ids, sampling_params(spec, 1), arrival=arrival, observe=False)
        lease.handles.append(handle)
        async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT):
            async with contextlib.aclosing(outcomes(ctx, handle, spec)) as items:
                async for _ in items:
                    pass
    except TimeoutError as exc:
        raise unavailable("the engine produced no token in time", code="engine_stuck") from exc
    finally:
        lease.close()
    return Response(status_code=200)


def _spec(ctx: ServerContext, req: GenerateRequest) -> GenSpec:
    sp = req.sampling_params
    if sp is None:
        return GenSpec()
    return gen_spec(ctx, sp, seed=sp.sampling_seed, min_tokens=sp.min_new_tokens, prefix="sampling_params.")


def _finish(out: Outcome) -> dict[str, Any]:
    if out.finish_reason == "length":
        return {"type": "length", "length": out.completion_tokens}
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.matched_stop}
    return {"type": out.finish_reason, "message": "request aborted"}


class _Logprobs:
    """What `return_logprob` adds to `meta_info`: SGLang's lists for the prompt from
    `logprob_start_len` (none at its default -1) and for the output, `top_logprobs_num` alternatives
    each. A PD prefill server leaves the prompt's out: the decode server returns them (they come with
    the transferred state), and sglang-router 0.3.2 prepends the prefill's list to the decode's."""

    def __init__(self, ctx: ServerContext, req: GenerateRequest) -> None:
        self.on = bool(req.return_logprob)
        self.top = req.top_logprobs_num or 0
        self.start = -1 if req.logprob_start_len is None else req.logprob_start_len
        self.own_prompt = ctx.settings.disaggregation_mode != "prefill"  # computed, sent, not returned
        self.words = token_text(ctx.tokenizer) if req.return_text_in_logprobs else None

    def apply(self, spec: GenSpec) -> None:
        if self.on:
            spec.logprobs = self.top
            if self.start >= 0:
                spec.prompt_logprobs = self.top  # only these requests pay for every prompt row

    def meta(
        self, prompt: list[int], prompt_lps: list[Any] | None, ids: list[int], lps: list[Any] | None
    ) -> dict[str, Any]:
        if not self.on:
            return {}
        return {**self.prompt_part(prompt, prompt_lps), **self.output_part(ids, lps)}

    def prompt_part(self, prompt: list[int], prompt_lps: list[Any] | None) -> dict[str, Any]:
        lo = min(self.start, len(prompt)) if self.start >= 0 and self.own_prompt else len(prompt)
        entries = (prompt_lps or [None] * len(prompt))[lo:]
        inp, inp_top = sglang_logprobs(entries, prompt[lo:], self.top, self.words)
        return {"input_token_logprobs": inp, "input_top_logprobs": inp_top}

    def output_part(self, ids: list[int], lps: list[Any] | None) -> dict[str, Any]:
        out, out_top = sglang_logprobs(lps or [], ids[: len(lps or [])], self.top, self.words)
        return {"output_token_logprobs": out, "output_top_logprobs": out_top}


class _StreamedLogprobs:
    """One streamed choice's cumulative `meta_info` lists: the prompt's built once, when they come
    (with the first token), and the output's extended by each piece, so a chunk costs its own tokens,
    not the whole response again."""

    def __init__(self, lp: _Logprobs, prompt: list[int]) -> None:
        self.lp, self.prompt = lp, prompt
        self.inputs: dict[str, Any] | None = None
        self.outputs: dict[str, list[Any]] = {"output_token_logprobs": [], "output_top_logprobs": []}

    def _inputs(self, prompt_lps: list[Any] | None) -> dict[str, Any]:
        if self.inputs is not None:
            return self.inputs
        part = self.lp.prompt_part(self.prompt, prompt_lps)
        if prompt_lps is not None or self.lp.start < 0:  # final: they came, or none are wanted
            self.inputs = part
        return part

    def piece(self, piece: Piece) -> dict[str, Any]:
        if not self.lp.on:
            return {}
        new = self.lp.output_part(piece.token_ids, piece.logprobs)
        for key, values in new.items():
            self.outputs[key].extend(values)
        return {**self._inputs(piece.prompt_logprobs), **self.outputs}

    def outcome(self, out: Outcome) -> dict[str, Any]:
        # The whole output again: a stop string's last tokens may come in no piece.
        if not self.lp.on:
            return {}
        return {**self._inputs(out.prompt_logprobs), **self.lp.output_part(out.token_ids, out.logprobs)}


def _result(
    rid: str,
    text: str,
    ids: list[int],
    prompt: list[int],
    out: Outcome | None,
    arrival: float,
    logprobs: dict[str, Any],
    index: int | None = None,
    cached: int = 0,
) -> dict[str, Any]:
    body = {
        "text": text,
        "output_ids": list(ids),
        "meta_info": {
            "id": rid,
            "finish_reason": None if out is None else _finish(out),
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "cached_tokens": cached,
            "e2e_latency": time.monotonic() - arrival,
            "weight_version": "default",
            **logprobs,
        },
    }
    if index is not None:
        body["index"] = index  # which of the n choices (SGLang's streamed chunks with n > 1)
    return body


@router.post("/generate", response_model=None)
async def generate(req: GenerateRequest, request: Request) -> Response:
    # SGLang's switches: `log_metrics: false` (probes) and `no_logs`.
    call = Call.begin(request, req, "generate", metrics=req.log_metrics is not False, logs=not req.no_logs)
    ctx = call.ctx
    if req.stream and req.is_batch():
        raise bad_request("stream=true needs a single prompt, not a batch", "stream")
    texts = req.prompts()
    prompts = [await encode_prompt(ctx, p, "text" if req.text is not None else "input_ids") for p in texts]
    sp = req.sampling_params
    n = (sp.n if sp is not None else None) or 1
    rids = req.rid if isinstance(req.rid, list) else [req.rid] * len(prompts)
    if len(rids) != len(prompts):
        raise bad_request("rid must have one entry per prompt", "rid")
    rids = [r or uuid.uuid4().hex for r in rids]
    spec = _spec(ctx, req)
    lp = _Logprobs(ctx, req)
    lp.apply(spec)
    requested = GENERATE_DEFAULT_MAX_NEW_TOKENS
    if sp is not None and sp.max_new_tokens is not None:
        requested = sp.max_new_tokens
    prompt_param = "text" if req.text is not None else "input_ids"
    seqs, params = prepare_sequences(
        ctx, spec, prompts, requested, n, prompt_param, "sampling_params.max_new_tokens",
        min_tokens_param="sampling_params.min_new_tokens",
    )  # fmt: skip
    streams = await call.start(req, spec, seqs, params, n)
    if req.stream:
        return call.stream(_stream(call, streams, rids[0], prompts[0], lp))
    outs = await call.collect(streams)
    results = []
    for i, o in enumerate(outs):
        prompt = seqs[i]
        meta = lp.meta(prompt, o.prompt_logprobs, o.token_ids, o.logprobs)
        results.append(
            _result(rids[i // n], o.text, o.token_ids, prompt, o, call.arrival, meta, cached=o.cached_tokens)
        )
    return JSONResponse(results if req.is_batch() or n > 1 else results[0])


async def _stream(
    call: Call, streams: Streams, rid: str, prompt: list[int], lp: _Logprobs
) -> AsyncGenerator[bytes, None]:
    # SGLang streams cumulative text, output_ids and logprobs in every chunk; with n > 1 each chunk
    # names its choice (`index`).
    n, arrival = len(streams), call.arrival
    text, ids = [""] * n, [[] for _ in range(n)]
    logprobs = [_StreamedLogprobs(lp, prompt) for _ in range(n)]
    async with contextlib.aclosing(merge(streams)) as items:
        async for i, item in items:
            index = i if n > 1 else None
            if isinstance(item, Piece):
                text[i] += item.text
                ids[i].extend(item.token_ids)
                meta = logprobs[i].piece(item)
                yield sse(
                    _result(rid, text[i], ids[i], prompt, None, arrival, meta, index, item.cached_tokens)
                )
            else:
                call.finished(item)
                meta = logprobs[i].outcome(item)
                yield sse(
                    _result(
                        rid, item.text, item.token_ids, prompt, item, arrival, meta, index, item.cached_tokens
                    )
                )
