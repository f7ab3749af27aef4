"""`dsv4 serve --prefix-cache-dir DIR`: the prefix cache's snapshots on disk.

A draining server writes every prefix its cache can resume at (`Engine.export_prefix_cache`) to
DIR/prefix-cache.safetensors, and a starting one imports them before it reports ready, so the first
requests after a restart, or on a new replica sharing DIR, resume from the cache instead of prefilling
again. The file carries the writer's layout fingerprint (disagg/fingerprint.py: page size, dtypes,
geometry, every buffer's page bytes, the checkpoint's digest); a server whose fingerprint differs
names the first differing field and starts cold. The file is written to a temporary name and renamed,
so a reader never sees half of one, and when servers share DIR the last to drain wins. A missing,
unreadable or mismatched file never stops a server from starting.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from dsv4_engine.memory import StateType
from dsv4_engine.memory.prefix_store import PrefixRecord
from dsv4_engine.server.state import ServerContext

log = logging.getLogger("dsv4.server")

FILE_NAME = "prefix-cache.safetensors"


def write(path: Path, records: list[PrefixRecord], fingerprint: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    tensors = {
        f"{i}.{state_type.name}.{b}": data.contiguous()
        for i, rec in enumerate(records)
        for state_type, buffers in rec.pages.items()
        for b, data in enumerate(buffers)
    }
    # Token ids as tensors: the header (JSON, at most 100 MB) would not hold a large cache's.
    tensors |= {f"{i}.tokens": torch.tensor(rec.tokens, dtype=torch.int64) for i, rec in enumerate(records)}
    tensors |= {
        f"{i}.extra.{k}": t.contiguous() for i, rec in enumerate(records) for k, t in rec.extra.items()
    }
    index = [{"base": r.base, "buffers": _buffer_counts(r), "extra": sorted(r.extra)} for r in records]
    meta = {"fingerprint": json.dumps(fingerprint), "records": json.dumps(index)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind


def _buffer_counts(rec: PrefixRecord) -> dict[str, int]:
    return {state_type.name: len(buffers) for state_type, buffers in rec.pages.items()}


def read(path: Path, fingerprint: dict[str, Any]) -> list[PrefixRecord]:
    """The records of a file written under `fingerprint`; ValueError naming what differs otherwise."""
    from safetensors import safe_open

    from dsv4_engine.disagg.fingerprint import fingerprint_diff

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        try:
            theirs = json.loads(meta["fingerprint"])
            index = json.loads(meta["records"])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{path} is not a prefix-cache file: {exc}") from exc
        diff = fingerprint_diff(fingerprint, theirs)
        if diff is not None:
            raise ValueError(f"{path} was written by a server of another layout: {diff}")
        records = []
        for i, entry in enumerate(index):
            pages: dict[StateType, list[torch.Tensor]] = {}
            for name, count in entry["buffers"].items():
                pages[StateType[name]] = [f.get_tensor(f"{i}.{name}.{b}") for b in range(count)]
            tokens = tuple(f.get_tensor(f"{i}.tokens").tolist())
            extra = {k: f.get_tensor(f"{i}.extra.{k}") for k in entry.get("extra", [])}
            records.append(PrefixRecord(tokens, int(entry["base"]), pages, extra))
    return records


async def _fingerprint(ctx: ServerContext) -> dict[str, Any]:
    """This server's layout fingerprint (a PD server has computed it already)."""
    if ctx.fingerprint is not None:
        return ctx.fingerprint
    from dsv4_engine.disagg.checkpoint import checkpoint_digest
    from dsv4_engine.disagg.fingerprint import layout_fingerprint

    engine = ctx.engine
    digest = await asyncio.to_thread(checkpoint_digest, ctx.settings.model)
    return layout_fingerprint(engine.layout, engine.kv_pool.pd_state_components(), digest)


async def restore(ctx: ServerContext) -> None:
    """At start, before ready: import DIR's file if there is one written under this layout."""
    assert ctx.settings.prefix_cache_dir is not None and ctx.bridge is not None
    path = Path(ctx.settings.prefix_cache_dir) / FILE_NAME
    ctx.prefix_fingerprint = await _fingerprint(ctx)
    if not path.exists():
        log.info("prefix cache: no %s yet; starting cold", path)
        return
    started = time.monotonic()
    try:
        records = await asyncio.to_thread(read, path, ctx.prefix_fingerprint)
    except Exception as exc:  # unreadable, truncated, not safetensors, another layout: start cold
        log.warning("prefix cache: not loaded, starting cold: %s", exc)
        return
    try:
        done = await ctx.bridge.run(lambda engine: engine.import_prefix_cache(records))
    except ValueError as exc:  # a damaged record; the ones before it are cached
        log.warning("prefix cache: import stopped: %s", exc)
        return
    ctx.metrics.prefix_imported.set(done)
    log.info(
        "prefix cache: imported %d of %d prefixes from %s in %.2fs",
        done, len(records), path, time.monotonic() - started,
    )  # fmt: skip


async def persist(ctx: ServerContext) -> None:
    """After a drain: write every resumable prefix to DIR's file (nothing when the cache is empty)."""
    assert ctx.settings.prefix_cache_dir is not None
    if ctx.bridge is None or ctx.bridge.dead is not None or ctx.prefix_fingerprint is None:
        return
    path = Path(ctx.settings.prefix_cache_dir) / FILE_NAME
    started = time.monotonic()
    try:
        records = await ctx.bridge.run(lambda engine: engine.export_prefix_cache())
        if not records:
            log.info("prefix cache: empty, %s left as it is", path)
            return
        await asyncio.to_thread(write, path, records, ctx.prefix_fingerprint)
    except (OSError, ValueError, RuntimeError) as exc:
        log.warning("prefix cache: not saved: %s", exc)
        return
    log.info("prefix cache: saved %d prefixes to %s in %.2fs", len(records), path, time.monotonic() - started)
