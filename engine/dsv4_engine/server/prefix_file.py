"""`dsv4 serve --prefix-cache-dir DIR`: the prefix cache's snapshots on disk.

A server writes the prefixes its cache can resume at (`Engine.export_prefix_cache`) to
DIR/prefix-cache.safetensors every `--prefix-cache-save-interval` seconds while it serves, when the
cache changed, and once more after it drains; a starting one imports them before it reports ready. So
the first requests after a restart (a crash loses at most an interval), or on a new replica sharing DIR,
resume from the cache instead of prefilling again. `--prefix-cache-max-bytes` caps the file: the most
recently used prefixes that fit. The file carries the writer's layout fingerprint
(disagg/fingerprint.py: page size, dtypes, geometry, every buffer's page bytes, the checkpoint's
digest); a server whose fingerprint differs names the first differing field and starts cold. The file
is written to a temporary name and renamed, so a reader never sees half of one, and when servers share
DIR the last to save wins. A missing, unreadable or mismatched file never stops a server from starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from dsv4_engine.memory import StateType
from dsv4_engine.memory.prefix_store import PrefixExport, PrefixRecord
from dsv4_engine.server.state import Phase, ServerContext

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


class PrefixCacheFile:
    """A server's --prefix-cache-dir: imported at start, then saved every `--prefix-cache-save-interval`
    seconds while the server serves (when the cache changed; so a crash loses at most an interval),
    and once more after a drain. The one writer of the file for this process: saves never overlap."""

    def __init__(self, ctx: ServerContext) -> None:
        settings = ctx.settings
        assert settings.prefix_cache_dir is not None
        self.ctx = ctx
        self.path = Path(settings.prefix_cache_dir) / FILE_NAME
        self.interval = settings.prefix_cache_save_interval
        self.max_bytes = settings.prefix_cache_max_bytes
        self.fingerprint: dict[str, Any] | None = None
        self.saved_version: int | None = None  # the cache's change count the file holds
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._saver: asyncio.Task[None] | None = None

    async def restore(self) -> None:
        """At start, before ready: import the file if there is one written under this layout."""
        ctx = self.ctx
        assert ctx.bridge is not None
        self.fingerprint = await _fingerprint(ctx)
        if not self.path.exists():
            log.info("prefix cache: no %s yet; starting cold", self.path)
            return
        started = time.monotonic()
        try:
            records = await asyncio.to_thread(read, self.path, self.fingerprint)
        except Exception as exc:  # unreadable, truncated, not safetensors, another layout: start cold
            log.warning("prefix cache: not loaded, starting cold: %s", exc)
            return
        try:
            done, version = await ctx.bridge.run(
                lambda engine: (engine.import_prefix_cache(records), engine.prefix_cache_version())
            )
        except ValueError as exc:  # a damaged record; the ones before it are cached
            log.warning("prefix cache: import stopped: %s", exc)
            return
        ctx.metrics.prefix_imported.set(done)
        if done == len(records):
            self.saved_version = version  # the file holds what the cache holds: no save until it changes
        log.info(
            "prefix cache: imported %d of %d prefixes from %s in %.2fs",
            done, len(records), self.path, time.monotonic() - started,
        )  # fmt: skip

    def start_saving(self) -> None:
        """Once serving: save every interval (none when the interval is 0: only after a drain)."""
        if self.interval > 0 and self._saver is None:
            self._saver = asyncio.create_task(self._save_every_interval())

    async def _save_every_interval(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
                return
            except TimeoutError:
                pass
            if self.ctx.phase == Phase.READY:
                await self.save(serving=True)

    async def close(self, drained: bool) -> None:
        """Stop saving (a save under way finishes first); after a drain, save once more: nothing runs,
        so every prefix can be read."""
        self._stop.set()
        if self._saver is not None:
            with contextlib.suppress(Exception):
                await self._saver
        if drained:
            await self.save(serving=False)

    async def save(self, *, serving: bool) -> None:
        """Write the cache's prefixes, most recently used first up to --prefix-cache-max-bytes, unless
        the file holds them already. While serving, requests may hold every row or C4 state page a
        read goes through: then the file is left as it is for the next interval."""
        ctx = self.ctx
        async with self._lock:
            if ctx.bridge is None or ctx.bridge.dead is not None or self.fingerprint is None:
                return
            started = time.monotonic()
            cap = self.max_bytes

            def export(engine: Any) -> tuple[int, PrefixExport | None]:
                version = engine.prefix_cache_version()
                return version, None if version == self.saved_version else engine.export_prefix_cache(cap)

            try:
                version, got = await ctx.bridge.run(export)
                if got is None:
                    return
                read_s = time.monotonic() - started  # the engine did not step meanwhile
                if got.busy and serving:
                    log.info("prefix cache: %d prefixes busy; saving at the next interval", got.busy)
                    return
                if not got.records:
                    why = "no prefix fits --prefix-cache-max-bytes" if got.over_cap else "empty"
                    log.info("prefix cache: %s, %s left as it is", why, self.path)
                    return
                await asyncio.to_thread(write, self.path, got.records, self.fingerprint)
            except (OSError, ValueError, RuntimeError) as exc:
                log.warning("prefix cache: not saved: %s", exc)
                return
            self.saved_version = version
            ctx.metrics.prefix_saved.set(len(got.records))
            log.info(
                "prefix cache: saved %d prefixes to %s in %.2fs (read in %.2fs, between steps)%s",
                len(got.records), self.path, time.monotonic() - started, read_s,
                f"; {got.over_cap} over --prefix-cache-max-bytes left out" if got.over_cap else "",
            )  # fmt: skip
