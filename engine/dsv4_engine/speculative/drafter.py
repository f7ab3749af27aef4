"""The MTP layer as the draft model: after each target forward, one pass over the positions the
target just computed (their streams and the tokens that follow them, which fills the layer's window
rows), then k - 1 single-token passes that each feed the layer its own output and draft.

Drafts are the MTP layer's argmax (top-1, as SGLang's DeepSeek MTP). Rejection sampling in `verify`
treats them as point masses, so the output distribution is the target's whatever they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_engine.kernels import KernelSet
from dsv4_engine.model import Dsv4ForCausalLM
from dsv4_engine.model.mtp import MtpLayer
from dsv4_engine.model.packed import Packed, attention_inputs, pack_linears
from dsv4_engine.speculative.draft_batch import DraftBatch
from dsv4_engine.speculative.draft_cache import DraftCache


@dataclass(frozen=True)
class DraftRow:
    """What one request gives the drafter after a step: positions [start, start + len(next_ids))
    just computed by the target, whose streams are rows [lo, lo + len(next_ids)) of the step's
    last-layer streams (decode rows, then prefill rows), and the token that follows each (the last:
    the token the step sampled, or the next prompt token of an unfinished prefill). draft: whether to
    propose tokens (its next step decodes). No tensor: rank 0 sends the rows to a parallel server's
    other ranks, which draft from their own copy of the streams (ranks.py)."""

    request_id: str
    req_idx: int
    start: int
    lo: int
    next_ids: list[int]
    draft: bool
    window_from: int  # the first position whose MTP row the request's ring row holds
    # Resumed from a prefix-cache snapshot at start + 1: position `start` takes its stream from the
    # snapshot (`DraftCache.tail`), the rest from rows [lo, lo + len(next_ids) - 1) of the step's.
    carried: bool = False


class Drafter:
    def __init__(
        self, model: Dsv4ForCausalLM, cache: DraftCache, num_draft_tokens: int, kernels: KernelSet
    ) -> None:
        assert model.mtp is not None, "the model was built without its MTP layer"
        self.model = model
        self.mtp: MtpLayer = model.mtp[0]  # type: ignore[assignment]
        self.cache = cache
        self.k = num_draft_tokens
        self.kernels = kernels.for_decode(compiled=False)  # one row per token, as a decode step
        shared = self.mtp.mlp.shared_experts
        self.packs: tuple[Packed, Packed] | None = None  # int8 (W8A8) projections run one by one
        if all(p.dtype != torch.int8 for p in self.mtp.parameters()):
            self.packs = (
                pack_linears(attention_inputs(self.mtp.self_attn)),
                pack_linears([shared.gate_proj, shared.up_proj]),
            )

    def _pass(self, rows: list[tuple[DraftRow, int, list[int]]], streams: torch.Tensor) -> torch.Tensor:
        """One MTP forward over (row, first position, token ids) with their input streams; its
        output streams."""
        tokens = [(r.req_idx, r.window_from, start + j) for r, start, ids in rows for j in range(len(ids))]
        out_slots, window_slots, keep = self.cache.slots(tokens)
        device = streams.device
        ids = torch.tensor([t for _, _, ids in rows for t in ids], dtype=torch.long, device=device)
        positions = torch.tensor([t[2] for t in tokens], dtype=torch.long, device=device)
        batch = DraftBatch(
            ids, positions, self.cache.kv, out_slots, window_slots, keep, self.kernels, self.packs
        )
        self.model.model.prepare(batch)
        embeds = self.model.model.embed_tokens(batch.input_ids)
        return self.mtp.draft(streams, embeds, batch)

    def _argmax(self, streams: torch.Tensor) -> list[int]:
        hidden = self.mtp.hidden(streams, self.kernels)
        return self.model.compute_logits(hidden, self.kernels).argmax(dim=-1).tolist()

    def propose(self, rows: list[DraftRow], streams: torch.Tensor | None) -> dict[str, list[int]]:
        """Fill the MTP rows of every row's positions; k drafts for each row with `draft`. streams:
        the step's last-layer streams `[rows, hc, hidden]`, which the rows index."""
        cache = self.cache
        cache.held = {}  # only this step's rows: what a snapshot taken after it can keep
        if not rows or streams is None:
            return {}
        source = (
            torch.cat([streams, cache.tail.to(streams.dtype)]) if any(r.carried for r in rows) else streams
        )
        picked = torch.cat([_sources(r, len(streams)) for r in rows]).to(streams.device)
        inputs = source.index_select(0, picked)
        out = self._pass([(r, r.start, r.next_ids) for r in rows], inputs)
        ends = torch.tensor([len(r.next_ids) for r in rows]).cumsum(0) - 1
        idx = torch.tensor([r.req_idx for r in rows], device=streams.device)
        cache.tail.index_copy_(0, idx, inputs.index_select(0, ends.to(inputs.device)).to(cache.tail.dtype))
        for r in rows:
            cache.held[r.req_idx] = (r.window_from, r.start + len(r.next_ids) - 1)
            cache.resumed.pop(r.req_idx, None)
        drafting = [i for i, r in enumerate(rows) if r.draft]
        if not drafting or self.k == 0:
            return {}
        last = out.index_select(0, ends[drafting].to(out.device))
        chain = [rows[i] for i in drafting]
        drafts = [[t] for t in self._argmax(last)]
        for j in range(1, self.k):
            step = [
                (r, r.start + len(r.next_ids) + j - 1, [d[-1]]) for r, d in zip(chain, drafts, strict=True)
            ]
            last = self._pass(step, last)
            for d, t in zip(drafts, self._argmax(last), strict=True):
                d.append(t)
        return {r.request_id: d for r, d in zip(chain, drafts, strict=True)}


def _sources(row: DraftRow, num_streams: int) -> torch.Tensor:
    """Where each of row's input streams is in cat([the step's streams, DraftCache.tail])."""
    rest = torch.arange(row.lo, row.lo + len(row.next_ids) - row.carried)
    return torch.cat([torch.tensor([num_streams + row.req_idx]), rest]) if row.carried else rest
