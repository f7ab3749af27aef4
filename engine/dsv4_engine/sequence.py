"""A request as the scheduler sees it (`Sequence`), and one step's piece of it (`ScheduledChunk`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    req_idx: int | None = None
    num_computed: int = 0  # positions whose KV is in the pools
    finish_reason: str | None = None
    prompt_counted: bool = False
    # PD prefill: when it finishes (or is aborted) its pages stay held until `release`, because a
    # transfer may still be reading them.
    hold: bool = False
    num_forwarded: int = 0  # tokens of this request the model ran (PD: decode never re-runs the prompt)
    # Engine-side handles the scheduler never reads: the request's seeded sampling generator.
    generator: object | None = None
    grammar: object | None = None  # its llguidance matcher when params.grammar is set (dsv4_engine.grammar)
    # Logprobs for requests that ask (sampler.TokenLogprobs): the prompt's, entry p for token p + 1,
    # filled chunk by chunk (kept across a preemption, so a recompute does not repeat them); and the
    # tokens the latest step gave it (one, or a speculative verify's), entry i for token i.
    prompt_logprobs: list[Any] = field(default_factory=list)
    step_logprobs: list[Any] = field(default_factory=list)
    # Prefix cache: prompt tokens its first admission resumed from the cache (None: not admitted yet),
    # and the positions where its chunks end so the cache can keep a snapshot there.
    num_cached_tokens: int | None = None
    cache_cuts: set[int] = field(default_factory=set)
    # Speculative decoding: the tokens the MTP layer drafted after the last step, for the positions
    # after the last known token (the next step verifies them).
    draft_token_ids: list[int] = field(default_factory=list)
    # The first position whose MTP row its request row's draft ring holds (speculative/draft_cache.py):
    # set by its first MTP pass, or by a PD transfer's window; None again when it loses the row.
    draft_window_from: int | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end): `all_token_ids[start:end]` without building the whole
        list, which every step would otherwise do per request (O(context))."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : max(end - n, 0)]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(end - n, 0)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed


@dataclass
class ScheduledChunk:
    """Positions [start, end) of seq; sample: the chunk reaches the last known token, so the
    forward yields the next one (fixed when scheduled). drafts: a speculative verify's draft tokens,
    the chunk's last positions (past the known tokens)."""

    seq: Sequence
    start: int
    end: int
    drafts: list[int] = field(default_factory=list)
    sample: bool = field(init=False)
    token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        known = self.end - len(self.drafts)
        self.sample = known == self.seq.num_tokens
        self.token_ids = self.seq.tokens_between(self.start, known) + self.drafts

    @property
    def is_decode(self) -> bool:
        """The request's next token (one known token at its position, maybe drafts after it)."""
        return self.end - len(self.drafts) - self.start == 1 and self.sample and self.start > 0
