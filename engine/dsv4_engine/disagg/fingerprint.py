"""The PD layout fingerprint: what a prefill and a decode server must share before KV moves between them.

A decode server compares its fingerprint with the prefill's at the handshake and refuses the peer when
they differ, naming the field. The fingerprint holds the memory layout (state types, bytes per page of
every buffer, page size, dtypes, per-layer ratios, head dims, window) and a digest of the checkpoint
(checkpoint.py), never pointers or buffer lengths: pool sizes legitimately differ between prefill and
decode. Each room also carries a digest of its prompt, checked on both sides.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any

from dsv4_engine.memory.layout import Dsv4MemoryLayout
from dsv4_engine.memory.pools import StateComponent

FINGERPRINT_VERSION = 1

# ---------------------------------------------------------------------------------------------------
# The layout fingerprint

# The order fields are compared in: causes (page size, dtypes, geometry) before what follows from them
# (item lengths), so the message names the root difference. Unknown fields (a newer peer) come last.
FIELD_ORDER = (
    "version",
    "page_size",
    "kv_dtype",
    "index_dtype",
    "state_dtype",
    "compress_ratios",
    "head_dim",
    "index_head_dim",
    "window",
    "state_types",
    "buffer_counts",
    "item_lens",
    "checkpoint",
)


def layout_fingerprint(
    layout: Dsv4MemoryLayout, components: list[StateComponent], checkpoint: str
) -> dict[str, Any]:
    """A JSON-ready dict of everything PD peers must share (pointers and buffer lengths excluded)."""
    return {
        "version": FINGERPRINT_VERSION,
        **layout.describe(),
        "state_types": [str(c.state_type) for c in components],
        "buffer_counts": {str(c.state_type): len(c.item_lens) for c in components},
        "item_lens": {str(c.state_type): [int(n) for n in c.item_lens] for c in components},
        "checkpoint": checkpoint,
    }


def fingerprint_id(fingerprint: dict[str, Any]) -> str:
    """A short stable id (16 hex) of the fingerprint, for logs and /server_info."""
    canonical = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def fingerprint_diff(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """None if the fingerprints are equal; else one sentence naming the first differing field."""
    extra = sorted((mine.keys() | theirs.keys()) - set(FIELD_ORDER))
    for key in (*FIELD_ORDER, *extra):
        if key not in mine and key not in theirs:
            continue
        if key not in mine or key not in theirs:
            side = "this server" if key not in mine else "the peer"
            versions = f"fingerprint version {mine.get('version')} here, {theirs.get('version')} there"
            return f"layout field {key!r} is missing on {side} ({versions})"
        a, b = mine[key], theirs[key]
        if a != b:
            return _describe(key, a, b)
    return None


def _describe(key: str, a: Any, b: Any) -> str:
    if key == "checkpoint":
        return (
            f"layout field 'checkpoint' differs: this server has {_short(a)}, the peer has {_short(b)} "
            "(different weights, tokenizer, chat template or config)"
        )
    where = ""
    if isinstance(a, dict) and isinstance(b, dict):
        sub = next(k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k))
        where, a, b = f" for {sub}", a.get(sub), b.get(sub)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        where, a, b = f"{where} at index {i}", a[i], b[i]
    return f"layout field {key!r} differs{where}: this server has {a}, the peer has {b}"


def _short(digest: Any) -> str:
    kind, _, hexpart = str(digest).rpartition(":")
    return f"{kind}:{hexpart[:12]}" if kind else hexpart[:12]


# ---------------------------------------------------------------------------------------------------
# Prompt digest


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A 32-hex digest of the prompt's token ids, carried by each PD room and checked on both sides."""
    packed = array("q", (int(t) for t in token_ids))
    if sys.byteorder == "big":  # the same digest on any host
        packed.byteswap()
    h = hashlib.blake2b(digest_size=16, person=b"dsv4-prompt")
    h.update(struct.pack("<Q", len(packed)))
    h.update(packed.tobytes())
    return h.hexdigest()
