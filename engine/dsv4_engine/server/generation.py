"""One prompt through the engine: tokens in, text pieces and a final outcome out.

Shared by /v1/completions, /v1/chat/completions and /generate so that every endpoint streams and
finishes the same way: incremental detokenisation, stop strings cut across token boundaries, the
engine request aborted as soon as a stop string matches or the caller goes away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dsv4_engine.sampler import TokenLogprobs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.server.bridge import ErrorEvent, RequestHandle
from dsv4_engine.server.detokenizer import IncrementalDetokenizer
from dsv4_engine.server.errors import ApiError, bad_request, unavailable
from dsv4_engine.server.state import ServerContext
from dsv4_engine.server.stops import StopMatcher

log = logging.getLogger("dsv4.server")


@dataclass
class GenSpec:
    """What the endpoint asks of one sequence, beyond the prompt."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0  # stop strings also wait until more tokens than this exist, as vLLM's
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # per generated token: its logprob and this many top ones
    prompt_logprobs: int | None = None  # the same for every prompt token (echo with logprobs)
    # Completions' echo with max_tokens 0: the engine generates one token, which nobody sees.
    hide_output: bool = False
    grammar: str | None = None  # llguidance grammar (server/structured.py) the output must follow
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: the matched stop string is kept
    bad_words: list[list[int]] | None = None  # token sequences never generated (vLLM's bad_words)
    allowed_token_ids: list[int] | None = None  # the only tokens generated (vLLM's)


@dataclass
class Piece:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # the whole prompt's, when asked
    cached_tokens: int = 0  # prompt tokens resumed from the engine's prefix cache


@dataclass
class Outcome:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: str | int | None = None
    ttft: float | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cached_tokens: int = 0  # prompt tokens resumed from the engine's prefix cache

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def sampling_params(
    spec: GenSpec, max_tokens: int, *, min_tokens_param: str = "min_tokens"
) -> SamplingParams:
    if spec.grammar and spec.min_tokens:  # it would mask the EOS that a finished grammar forces
        raise bad_request("min_tokens cannot be combined with a grammar constraint", min_tokens_param)
    if spec.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({spec.min_tokens}) must not be more than the tokens the completion may have "
            f"({max_tokens})",
            min_tokens_param,
        )
    try:
        return SamplingParams(
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            max_tokens=max_tokens,
            ignore_eos=spec.ignore_eos,
            seed=spec.seed,
            stop_token_ids=list(spec.stop_token_ids),
            presence_penalty=spec.presence_penalty,
            frequency_penalty=spec.frequency_penalty,
            repetition_penalty=spec.repetition_penalty,
            min_p=spec.min_p,
            min_tokens=spec.min_tokens,
            logit_bias=dict(spec.logit_bias) if spec.logit_bias else None,
            logprobs=spec.logprobs,
            prompt_logprobs=spec.prompt_logprobs,
            grammar=spec.grammar,
            bad_words_token_ids=spec.bad_words,
            allowed_token_ids=spec.allowed_token_ids,
        )
    except ValueError as exc:  # SamplingParams names the field in its message
        raise bad_request(str(exc)) from exc


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request with `n > 1`: seed + index (mod 2**63), as vLLM; so
    choice 0 is what the same request with n = 1 returns."""
    return None if seed is None else (seed + index) % 2**63


def prepare_sequences(
    ctx: ServerContext,
    spec: GenSpec,
    prompts: list[list[int]],
    requested: int | None,
    n: int,
    prompt_param: str,
    limit_param: str,
    min_tokens_param: str = "min_tokens",
) -> tuple[list[list[int]], list[SamplingParams]]:
    """The sequences of a request: n per prompt, prompt-major (choice index = prompt * n + j), each
    an independent engine request (its prompt prefilled again) with seed + j."""
    seqs: list[list[int]] = []
    params: list[SamplingParams] = []
    for ids in prompts:
        limit = resolve_max_tokens(
            ctx, len(ids), requested, prompt_param=prompt_param, limit_param=limit_param
        )
        base = sampling_params(spec, limit, min_tokens_param=min_tokens_param)
        for j in range(n):
            seqs.append(ids)
            params.append(base if j == 0 else dataclasses.replace(base, seed=choice_seed(base.seed, j)))
    return seqs, params


def resolve_max_tokens(
    ctx: ServerContext, prompt_len: int, requested: int | None, *, prompt_param: str, limit_param: str
) -> int:
    """The engine's max_tokens: as requested (400 if it does not fit), or whatever the context leaves."""
    assert ctx.facts is not None
    limit = ctx.facts.max_model_len
    if prompt_len >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens; the prompt has {prompt_len} tokens.",
            prompt_param,
            "context_length_exceeded",
        )
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion).",
            limit_param,
            "context_length_exceeded",
        )
    return requested


def check_token_ids(ctx: ServerContext, ids: Iterable[int], param: str) -> None:
    assert ctx.facts is not None
    vocab = ctx.facts.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param)


class Lease:
    """Sequences started for one HTTP request; `close()` aborts any still running and ends the
    request's in-flight count. Idempotent, so every exit path may call it."""

    def __init__(self, ctx: ServerContext, handles: list[RequestHandle], release: Callable[[], None]) -> None:
        self.ctx = ctx
        self.handles = handles
        self._release = release

    def close(self) -> None:
        bridge = self.ctx.bridge
        for handle in self.handles:
            if bridge is not None:
                bridge.abort(handle)
        self._release()


def admit(ctx: ServerContext, n: int, targets: list[Any] | None) -> Callable[[], None]:
    """Refuse (503) if the server cannot take n more sequences now, else count them in flight (a
    drain waits for them); returns the release. A PD server that refuses ends the rooms too: a
    refusing decode tells the prefill, whose response then ends as well."""
    from dsv4_engine.server import pd

    try:
        ctx.check_admission(n)
    except ApiError as err:
        if targets:
            pd.abort_rooms(ctx, targets, err.code or "refused", err.message)
        raise
    return ctx.enter()


def start_all(
    ctx: ServerContext,
    prompts: list[list[int]],
    params: list[Any],
    *,
    arrival: float,
    observe: bool = True,
    targets: list[Any] | None = None,
    admitted: Callable[[], None] | None = None,
) -> Lease:
    """Admit and start every sequence of one HTTP request (no await between admission and engine,
    unless `admitted`: the release `admit` gave, the request in flight since).
    `targets`: one PdTarget per prompt on a prefill or decode server (server/pd.py)."""
    from dsv4_engine.server import pd

    release = admitted if admitted is not None else admit(ctx, len(prompts), targets)
    handles: list[RequestHandle] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            if targets:
                handles.append(pd.start(ctx, ids, p, targets[i], arrival=arrival, observe=observe))
            else:
                handles.append(start(ctx, ids, p, arrival=arrival, observe=observe))
    except BaseException:
        Lease(ctx, handles, release).close()
        raise
    return Lease(ctx, handles, release)


def start(
    ctx: ServerContext, prompt_ids: list[int], params: Any, *, arrival: float, observe: bool = True
) -> RequestHandle:
    """Hand one prompt to the engine (no await between admission and this call)."""
    bridge = ctx.bridge
    assert bridge is not None
    try:
        handle = bridge.add(uuid.uuid4().hex, prompt_ids, params, arrival=arrival)
    except RuntimeError as exc:
        raise unavailable("the engine failed; the server must be restarted", retry_after=5) from exc
    handle.prompt_len = len(prompt_ids)
    handle.observe = observe
    return handle


async def outcomes(
    ctx: ServerContext, handle: RequestHandle, spec: GenSpec
) -> AsyncIterator[Piece | Outcome]:
    """Yield text pieces as they become final, then one Outcome. Aborts the engine request on exit."""
    bridge = ctx.bridge
    assert bridge is not None
    detok = IncrementalDetokenizer(ctx.tokenizer, skip_special_tokens=spec.skip_special_tokens)
    stops = StopMatcher(spec.stop, include=spec.include_stop_str)
    ended = {*spec.stop_token_ids, *(ctx.facts.eos_token_ids if ctx.facts else [])}
    sent: list[str] = []  # exactly what the caller received
    logprobs: list[TokenLogprobs] | None = [] if spec.logprobs is not None else None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    try:
        while True:
            event = await handle.queue.get()
            if isinstance(event, ErrorEvent):
                if event.kind == "pd":
                    raise _pd_api_error(event.error)
                if event.kind == "dead":
                    raise unavailable("the engine failed; the server must be restarted", retry_after=5)
                if event.kind == "shutdown":
                    raise unavailable("the server is shutting down", code="server_stopped")
                raise ApiError(400, f"the engine refused the request: {event.error}", code="engine_rejected")
            final = event.finished
            if event.prompt_logprobs is not None:
                prompt_logprobs = event.prompt_logprobs
            new_logprobs = event.logprobs if logprobs is not None and not spec.hide_output else None
            if new_logprobs:
                logprobs.extend(new_logprobs)  # type: ignore[union-attr]
            if spec.hide_output:  # the prompt alone is the answer; the token made meanwhile is dropped
                text = ""
            else:
                # vLLM's rule: stop strings count only once more than min_tokens tokens exist
                armed = not spec.min_tokens or len(detok.token_ids) + len(event.token_ids) > spec.min_tokens
                text = stops.push(detok.push(event.token_ids, final=final), final=final, armed=armed)
            sent.append(text)
            if stops.matched is not None:
                if handle.pd_wait is not None:
                    await _transferred(handle)  # a PD prefill's one token: its transfer must end first
                else:
                    bridge.abort(handle)  # stop string reached: free the engine's pages now
                if text:
                    yield Piece(text, event.token_ids, new_logprobs, prompt_logprobs, handle.cached_tokens)
                yield _outcome(handle, sent, detok, "stop", stops.matched, logprobs, prompt_logprobs)
                return
            if not spec.hide_output and (text or event.token_ids):
                yield Piece(text, event.token_ids, new_logprobs, prompt_logprobs, handle.cached_tokens)
            if final:
                if handle.pd_wait is not None:  # PD prefill: done once the transfer ended
                    await _transferred(handle)
                reason = "length" if spec.hide_output else event.finish_reason or "stop"
                matched = None
                if reason == "stop" and detok.token_ids and detok.token_ids[-1] in ended:
                    matched = detok.token_ids[-1]
                yield _outcome(handle, sent, detok, reason, matched, logprobs, prompt_logprobs)
                return
    except asyncio.CancelledError:
        log.info("request %s cancelled (client gone); aborting it in the engine", handle.request_id)
        raise
    finally:
        bridge.abort(handle)  # no-op when the engine already finished it


async def _transferred(handle: RequestHandle) -> None:
    """Wait for a PD prefill request's transfer to end; its failure is the request's error."""
    assert handle.pd_wait is not None
    try:
        await asyncio.shield(handle.pd_wait)
    except Exception as exc:
        raise _pd_api_error(exc) from exc


def _pd_api_error(exc: BaseException) -> ApiError:
    from dsv4_engine.disagg.protocol import PdError
    from dsv4_engine.server.pd import pd_error

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PdError):
        return pd_error(exc)
    return ApiError(500, f"PD transfer failed: {exc}", type="server_error", code="pd_failed")


def _outcome(
    handle: RequestHandle,
    sent: list[str],
    detok: IncrementalDetokenizer,
    reason: str,
    matched: str | int | None,
    logprobs: list[TokenLogprobs] | None = None,
    prompt_logprobs: list[TokenLogprobs | None] | None = None,
) -> Outcome:
    ttft = None if handle.first_token_time is None else handle.first_token_time - handle.created
    return Outcome(
        "".join(sent),
        list(detok.token_ids),
        handle.prompt_len,
        reason,
        matched,
        ttft,
        logprobs,
        prompt_logprobs,
        handle.cached_tokens,
    )
