"""Grammar-constrained decoding: one llguidance matcher per request, token masks for the sampler.

llguidance (not xgrammar): one abi3 Rust wheel that depends on no torch at all (xgrammar's package
requires torch and, on Linux x86-64, triton: a GPU compiler on a CPU image), a backend of both vLLM and
SGLang; it builds a grammar lazily (no up-front compile against the vocabulary, so a request with a
new JSON schema costs about a millisecond) and computes masks on the CPU with the GIL released, so
the step's masks are computed on a worker thread while the model's forward runs (`start_masks`
before the forward, `PendingMasks.wait` just before sampling).

A request's grammar is the text `SamplingParams.grammar` carries (Lark with `%json` rules, as
`dsv4_engine.server.structured` builds it): plain data, so a PD decode server rebuilds the matcher
from the same request and advances it by the first token the prefill server sampled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

_BITS = torch.arange(32, dtype=torch.int32)
# Compact JSON: no free whitespace between tokens, so a model (even a random one) cannot pad forever.
_COMPACT = {"whitespace_flexible": False}


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark rule body matching JSON valid against `schema` (llguidance's `%json`)."""
    return "%json " + json.dumps({**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}})


def json_grammar(schema: dict[str, Any]) -> str:
    """A grammar whose whole output is one JSON value valid against `schema`."""
    return f"start: {json_rule(schema)}\n"


def check_grammar(grammar: str) -> str | None:
    """None if llguidance accepts `grammar`, else its error message (no tokenizer needed)."""
    from llguidance import LLMatcher

    err = LLMatcher.validate_grammar(grammar)
    return err or None


class GrammarBackend:
    """The tokenizer as llguidance sees it (built once, on the first constrained request), and the
    worker thread that fills masks."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-grammar")

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher at the grammar's start; ValueError if the grammar is bad."""
        from llguidance import LLMatcher

        m = LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"bad grammar: {m.get_error()}")
        return m

    def start_masks(
        self, matchers: dict[str, Any], drafts: dict[str, list[int]] | None = None
    ) -> PendingMasks:
        """Begin filling the allowed-token masks of `matchers` (request id -> matcher) in the worker:
        one row per request, or, for a request with `drafts` (a speculative verify), one per verify
        row: row j the mask after drafts[:j]."""
        plan = [(r, m, (drafts or {}).get(r, [])) for r, m in matchers.items()]
        return PendingMasks(self.pool.submit(self._fill, plan), lambda: self._fill(plan))

    def _fill(self, plan: list[tuple[str, Any, list[int]]]) -> dict[str, torch.Tensor]:
        import llguidance.torch as lltorch

        bitmask = torch.zeros(sum(1 + len(d) for _, _, d in plan), self.words, dtype=torch.int32)
        # One row after another on this one thread: it already runs beside the forward, and
        # llguidance's parallel executor would take cores from the forward's own threads.
        row, spans = 0, {}
        for rid, m, drafts in plan:
            consumed = 0  # drafts the grammar took so far; the matcher is rolled back over them after
            for j in range(len(drafts) + 1):
                if consumed == j:
                    lltorch.fill_next_token_bitmask(m, bitmask, row + j)
                    if j < len(drafts) and not m.is_stopped():
                        consumed += m.try_consume_tokens([drafts[j]])
                else:  # past a draft the grammar refused: verify rejects that draft, never reads these
                    bitmask[row + j] = bitmask[row + j - 1]
            if consumed:
                m.rollback(consumed)
            spans[rid] = (row, row + 1 + len(drafts))
            row += 1 + len(drafts)
        allowed = ((bitmask[:, :, None] >> _BITS) & 1).bool().view(len(bitmask), -1)[:, : self.vocab_size]
        return {rid: allowed[lo:hi] for rid, (lo, hi) in spans.items()}


class PendingMasks:
    """Masks being computed for one step: per request, its rows (one, or a verify's k + 1)."""

    def __init__(
        self, masks: Future[dict[str, torch.Tensor]], fill: Callable[[], dict[str, torch.Tensor]]
    ) -> None:
        self.masks = masks
        self.fill = fill
        self._done: dict[str, torch.Tensor] | None = None

    def rows(self, request_id: str, eos_token_ids: Seq[int] = ()) -> torch.Tensor | None:
        """The request's allowed tokens, bool `[rows, V]`; None if it has no grammar."""
        if self._done is None:
            # A worker that never got a core during the forward has not started: fill here instead.
            self._done = self.fill() if self.masks.cancel() else self.masks.result()
        allowed = self._done.get(request_id)
        if allowed is None:
            return None
        # A matcher in an error state allows nothing: let it end (EOS) rather than sample from -inf.
        empty = ~allowed.any(dim=-1)
        if bool(empty.any()) and eos_token_ids:
            allowed[empty.nonzero()[:, 0][:, None], torch.tensor(list(eos_token_ids))[None, :]] = True
        return allowed

    def wait(self, order: Seq[str], eos_token_ids: Seq[int] = ()) -> tuple[list[int], torch.Tensor] | None:
        """The one-token rows of the requests in `order` that have a grammar: (their indices in
        `order`, bool `[R, V]`)."""
        found = [(i, self.rows(r, eos_token_ids)) for i, r in enumerate(order)]
        keep = [(i, rows[0]) for i, rows in found if rows is not None]
        if not keep:
            return None
        return [i for i, _ in keep], torch.stack([row for _, row in keep])


def advance(matcher: Any, token: int) -> None:
    """Feed the sampled token; a token the grammar refuses (ignore_eos past the end) leaves the
    matcher in its error state, whose mask then only lets the request end."""
    if not matcher.is_stopped():
        matcher.consume_token(token)
