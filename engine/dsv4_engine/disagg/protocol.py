"""What prefill and decode servers say to each other, and what both check on a PD request.

The request contract is SGLang's: sglang-router sends the same body to a prefill and a decode server,
with `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (arrays for a batch, one room per
prompt). The prefill server runs a bootstrap endpoint (bootstrap.py); the decode server talks to it:

  decode                                   prefill bootstrap (HTTP, one per prefill server)
  GET  /route                         ->   fingerprint, ranks (Mooncake session per rank)
  PUT  /sessions/{decode_id}          ->   its fingerprint and destination buffer pointers (once), and
                                           each other rank's session and pointers (lanes.py)
  PUT  /rooms/{room}                  ->   claims the room: prompt digest and length (at arrival)
  POST /rooms/{room}/transfer         ->   destination pages per state type, aux slot and (if the
                                           decode has room) a staging span; the answer is held
                                           until the transfer ended (success/failed), and lists the
                                           segments that went staged, for the decode to unpack
  DELETE /rooms/{room}                ->   abort (queue full, client gone, timeout); the answer says
                                           whether a write may still land ("writing": quarantine)
  GET  /health                        ->   heartbeat

The aux slot carries what the decode side needs to continue sampling exactly as one server would:
the first token and the request's seeded generator state. Logprobs, which only the prefill computed
(the first token's and, with echo, the prompt's), travel in the transfer's answer (`logprobs_body`):
they can be as long as the prompt, and the decode server returns them as one colocated server would.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dsv4_engine.memory import Dsv4TokenToKVPool, StateComponent, StateType
from dsv4_engine.memory.staging import StagingArena, staged_nbytes
from dsv4_engine.sampler import TokenLogprobs
from dsv4_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dsv4_engine.disagg.base import Transport

# Bytes of one request's aux slot: int64 first token, int64 generator-state length, the state
# (5056 bytes for torch's CPU Mersenne Twister, 16 on CUDA), padded.
AUX_BYTES = 8192
_AUX_HEAD = struct.Struct("<qq")
MAX_ROOM = 2**64
MAX_DRAFT_TOKENS = 64  # more drafts than any --speculative-num-steps worth running


class RoomStatus(enum.IntEnum):
    """SGLang's KVPoll order: Failed < Bootstrapping < WaitingForInput < Transferring < Success."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


class PdError(Exception):
    """A PD request that cannot go on; `reason` labels the failure metric, `status` the HTTP answer."""

    def __init__(self, reason: str, message: str, *, status: int = 502, retry_after: int | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.status = status
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"reason": self.reason, "message": self.message, "status": self.status}

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> PdError:
        """A peer's failure, relayed: the request's own faults stay 400 on this leg too, whichever leg
        found them first (a prompt mismatch is found by the prefill or the decode, as the race goes)."""
        reason = str(body.get("reason", "peer_error"))
        return cls(reason, str(body.get("message", body)), status=400 if reason in CLIENT_ERRORS else 502)


# Failures that are the request's fault, not a server's: a 400 on both legs.
CLIENT_ERRORS = frozenset({"room_in_use", "prompt_mismatch"})


@dataclass(frozen=True)
class PdTarget:
    """Where one prompt's state comes from (decode) or goes to (prefill): the router's three fields."""

    host: str
    port: int
    room: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def register_state(
    transport: Transport,
    kv_pool: Dsv4TokenToKVPool,
    rows: int,
    staging: StagingArena | None = None,
    draft: torch.Tensor | None = None,
) -> tuple[list[StateComponent], torch.Tensor]:
    """Register every buffer of `pd_state_components()`, an aux slot per request row, the staging
    arena and the MTP window slots (`draft`: `[rows, window, width]`, when the engine speculates)
    with the transport, once: the same on both sides (the prefill reads from them, the decode is
    written)."""
    components = kv_pool.pd_state_components()
    aux = torch.zeros((rows, AUX_BYTES), dtype=torch.uint8)
    extra = [(aux.data_ptr(), aux.nbytes)]
    if staging is not None:
        extra.append((staging.data_ptr, staging.nbytes))
    if draft is not None:
        extra.append((draft.data_ptr(), draft.nbytes))
    transport.register(
        [p for c in components for p in c.data_ptrs] + [p for p, _ in extra],
        [n for c in components for n in c.data_lens] + [n for _, n in extra],
    )
    return components, aux


def staged_bytes(kv_pool: Dsv4TokenToKVPool, pages: dict[StateType, list[int]]) -> int:
    """Bytes the pages of every listed state type take packed (memory.staging's layout)."""
    buffers = kv_pool.buffers_by_type()
    return sum(staged_nbytes(buffers[t], sum(1 for p in ids if p)) for t, ids in pages.items())


def stage_segments(
    kv_pool: Dsv4TokenToKVPool,
    segments: list[tuple[StateType, list[int]]],
    span: torch.Tensor,
    copy: Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor], None],
) -> int:
    """Run `copy` (staging.gather_pages or scatter_pages) over (state type, page list) segments laid
    out one after another in `span` (sentinel pages skipped); returns the bytes used. Both sides walk
    the same segments over their own page lists, so equal lists give equal layouts."""
    buffers = kv_pool.buffers_by_type()
    at = 0
    for state_type, ids in segments:
        pages = [p for p in ids if p]
        if not pages:
            continue
        n = staged_nbytes(buffers[state_type], len(pages))
        if at + n > span.numel():
            raise PdError(
                "payload_mismatch", f"staged {state_type} pages overrun the {span.numel()}-byte staging span"
            )
        copy(buffers[state_type], torch.tensor(pages, dtype=torch.long), span[at : at + n])
        at += n
    return at


def quarantine_seconds(env: dict[str, str]) -> float:
    """How long a decode keeps pages a late write may land in when the prefill cannot say whether one
    still can (stalled or unreachable): Mooncake's transfer timeout plus a margin."""
    from dsv4_engine.disagg.mooncake.config import LATE_MARGIN_SECONDS, transfer_timeout_s

    return transfer_timeout_s(env) + LATE_MARGIN_SECONDS


def pack_aux(buf: torch.Tensor, first_token: int, generator: torch.Generator | None) -> None:
    """Write one aux slot (`buf`: uint8 [AUX_BYTES])."""
    state = generator.get_state() if generator is not None else torch.empty(0, dtype=torch.uint8)
    n = int(state.numel())
    if _AUX_HEAD.size + n > AUX_BYTES:
        raise ValueError(f"generator state of {n} bytes does not fit the aux slot")
    head = torch.frombuffer(bytearray(_AUX_HEAD.pack(first_token, n)), dtype=torch.uint8)
    buf[: _AUX_HEAD.size].copy_(head)
    buf[_AUX_HEAD.size : _AUX_HEAD.size + n].copy_(state.to(torch.uint8).cpu())


def unpack_aux(buf: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """(first token, generator state or None) from one aux slot."""
    token, n = _AUX_HEAD.unpack(bytes(buf[: _AUX_HEAD.size].tolist()))
    if not 0 <= n <= AUX_BYTES - _AUX_HEAD.size:
        raise PdError("bad_aux", f"aux slot holds an impossible generator-state length {n}")
    state = buf[_AUX_HEAD.size : _AUX_HEAD.size + n].clone() if n else None
    return int(token), state


# ---- the MTP window ------------------------------------------------------------------------------
def draft_slots(
    geometry: tuple[int, int, torch.dtype] | None, rows: int, device: torch.device
) -> torch.Tensor | None:
    """One slot per request row for the MTP layer's window rows (`[rows, window, width]`), which a
    prefill fills from its draft ring and writes into the decode's slot with the request's state;
    None when the engine does not speculate."""
    if geometry is None:
        return None
    window, width, dtype = geometry
    return torch.zeros((rows, window, width), dtype=dtype, device=device)


def draft_offer(slots: torch.Tensor | None) -> dict[str, int] | None:
    """What a prefill's /route offers and a decode's slots must match to take the window."""
    if slots is None:
        return None
    return {"window": slots.shape[1], "row_bytes": slots[0, 0].nbytes}


def read_window_from(value: Any, prompt_len: int, window: int) -> int | None:
    """The first position of a transferred MTP window, checked: the rows are positions
    [value, prompt_len), at most `window` of them."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= prompt_len - value <= window:
        raise PdError(
            "payload_mismatch",
            f"draft_window_from {value!r} is not within {window} positions before {prompt_len}",
        )
    return value if value < prompt_len else None


# ---- logprobs in the transfer's answer ----------------------------------------------------------
def _entry(e: TokenLogprobs) -> list[Any]:
    def value(lp: float) -> float | None:
        return lp if math.isfinite(lp) else None  # JSON has no infinity; None reads back as -inf

    return [e.token_id, value(e.logprob), [[t, value(lp)] for t, lp in e.top]]


def _read_entry(item: Any) -> TokenLogprobs:
    def value(lp: Any) -> float:
        if lp is None:
            return -math.inf
        if isinstance(lp, bool) or not isinstance(lp, (int, float)):
            raise TypeError(f"logprob {lp!r} is not a number")
        return float(lp)

    token, lp, top = item
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"token id {token!r} is not an integer")
    return TokenLogprobs(token, value(lp), [(int(t), value(v)) for t, v in top])


def logprobs_body(first: TokenLogprobs | None, prompt: list[TokenLogprobs] | None) -> dict[str, Any] | None:
    """What the prefill computed that the decode cannot: the first token's logprobs and the prompt's
    (entry i for prompt token i + 1), each present only when the request asked for it."""
    if first is None and prompt is None:
        return None
    return {
        "first": None if first is None else _entry(first),
        "prompt": None if prompt is None else [_entry(e) for e in prompt],
    }


def read_cached_tokens(value: object, prompt_len: int) -> int:
    """The prefill's count of prompt tokens it resumed from its prefix cache (0 from a prefill that
    does not send it); anything but a count within the prompt fails the request."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < max(prompt_len, 1):
        raise PdError("payload_mismatch", f"cached_tokens {value!r} does not fit a prompt of {prompt_len}")
    return value


def read_draft_tokens(value: object, vocab_size: int) -> list[int]:
    """The prefill's MTP drafts for the tokens after the first (none from a prefill that does not
    speculate); anything but a short list of token ids fails the request."""
    if value is None:
        return []
    if (
        not isinstance(value, list)
        or len(value) > MAX_DRAFT_TOKENS
        or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in value)
    ):
        raise PdError("payload_mismatch", f"draft_token_ids {value!r} are not token ids of this model")
    return value


def read_logprobs(
    body: dict[str, Any] | None, params: SamplingParams, prompt_ids: list[int], first_token: int
) -> tuple[TokenLogprobs | None, list[TokenLogprobs] | None]:
    """The logprobs of `logprobs_body` the request asked for, checked against what the decode knows
    (the first token, the prompt): a missing or mismatched list fails the request, never a guess."""

    def mismatch(what: str) -> PdError:
        return PdError("payload_mismatch", f"the prefill's logprobs do not fit the request: {what}")

    body = body or {}
    first: TokenLogprobs | None = None
    prompt: list[TokenLogprobs] | None = None
    try:
        if params.logprobs is not None:
            if body.get("first") is None:
                raise mismatch("the first token's logprobs are missing")
            first = _read_entry(body["first"])
            if first.token_id != first_token:
                raise mismatch(f"they are for token {first.token_id}, the first token is {first_token}")
        if params.prompt_logprobs is not None:
            if body.get("prompt") is None:
                raise mismatch("the prompt's logprobs are missing")
            prompt = [_read_entry(e) for e in body["prompt"]]
            if [e.token_id for e in prompt] != prompt_ids[1:]:
                raise mismatch(f"{len(prompt)} prompt entries for a prompt of {len(prompt_ids)} tokens")
    except (TypeError, ValueError, AttributeError) as exc:
        raise mismatch(str(exc)) from exc
    return first, prompt
