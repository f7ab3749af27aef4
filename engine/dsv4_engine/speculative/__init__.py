"""Speculative decoding with DeepSeek-V4's MTP layer (docs/speculative.md).

Each decode step of a speculating request verifies the k tokens its MTP layer drafted last step:
the target model runs over [pending token, d_1 .. d_k] in one forward (a decode row each), the scheduler keeps the
accepted prefix plus one token of the target's own, and the allocator cuts the row back to it
(`Dsv4Allocator.truncate`). Then the MTP layer drafts the next k from the target's streams
(`Drafter`, over a `DraftBatch`: one row per token, as a decode step). The draft's window rows live in
`DraftCache`, a ring per request row outside the paged pools: they decide only which tokens are
proposed, never which are kept, so nothing there needs the pools' exactness, their rollback, PD
transfer or prefix caching.
"""

from dsv4_engine.speculative.accept import verify, verify_logits
from dsv4_engine.speculative.draft_cache import DraftCache
from dsv4_engine.speculative.drafter import Drafter, DraftRow

__all__ = ["DraftCache", "DraftRow", "Drafter", "verify", "verify_logits"]
