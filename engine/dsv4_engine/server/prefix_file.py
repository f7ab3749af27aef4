"""`dsv4 serve --prefix-cache-dir DIR`: the prefix cache's snapshots on disk.

A server writes the prefixes its cache can resume at (`Engine.export_prefix_cache`) to a file of its
own, DIR/prefix-cache-<host>-<port>.safetensors, every `--prefix-cache-save-interval` seconds while it
serves, when the cache changed, and once more after it drains; a starting one imports its own file,
then the other servers' in DIR, before it reports ready. So the first requests after a restart (a
crash loses at most an interval), or on a new replica sharing DIR, resume from the cache instead of
prefilling again. `--prefix-cache-max-bytes` caps the file: the most recently used prefixes that fit.
A file carries its writer's layout fingerprint (disagg/fingerprint.py: page size, dtypes, geometry,
every buffer's page bytes, the checkpoint's digest); a server whose fingerprint differs names the
first differing field and passes the file over. A file is written to a temporary name and renamed, so
a reader never sees half of one. A missing, unreadable or mismatched file never stops a server from
starting. A volume too full for a save loses the files of servers gone first (`make_room`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import socket
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from dsv4_engine.memory import StateType
from dsv4_engine.memory.prefix_store import PrefixExporter, PrefixRecord
from dsv4_engine.server.state import Phase, ServerContext

log = logging.getLogger("dsv4.server")

FILE_STEM = "prefix-cache"
HEADER_BYTES_PER_TENSOR = 160  # its JSON entry's dtype, shape and offsets, and some
# A save while serving reads the cache in parts of about this long, each between two steps.
SAVE_PART_SECONDS = 0.02
LIVE_GRACE_SECONDS = 60.0  # beyond 2 intervals, before another server's unchanged file counts as left


# A file's tensors by name and its metadata: built once a save, sized (`file_bytes`), then written.
Contents = tuple[dict[str, torch.Tensor], dict[str, str]]


def contents(records: list[PrefixRecord], fingerprint: dict[str, Any]) -> Contents:
    """A file's tensors by name and its metadata (the fingerprint, and per record its base, buffer
    counts and extra names)."""
    tensors = {
        f"{i}.{state_type.name}.{b}": data
        for i, rec in enumerate(records)
        for state_type, buffers in rec.pages.items()
        for b, data in enumerate(buffers)
    }
    # Token ids as tensors: the header (JSON, at most 100 MB) would not hold a large cache's.
    tensors |= {f"{i}.tokens": torch.tensor(rec.tokens, dtype=torch.int64) for i, rec in enumerate(records)}
    tensors |= {f"{i}.extra.{k}": t for i, rec in enumerate(records) for k, t in rec.extra.items()}
    index = [{"base": r.base, "buffers": _buffer_counts(r), "extra": sorted(r.extra)} for r in records]
    return tensors, {"fingerprint": json.dumps(fingerprint), "records": json.dumps(index)}


def write(path: Path, file: Contents) -> None:
    from safetensors.torch import save_file

    tensors, meta = file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind


def file_bytes(file: Contents) -> int:
    """At least what `write` puts on disk: the tensors' bytes, and a header of JSON naming each with its
    dtype, shape and offsets (HEADER_BYTES_PER_TENSOR, generously) beside the metadata (twice: its
    quotes are escaped there); a large model's record has thousands of tensors, so not negligible."""
    tensors, meta = file
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    header = sum(len(k) + HEADER_BYTES_PER_TENSOR for k in tensors) + 2 * sum(len(v) for v in meta.values())
    return data + header


def _buffer_counts(rec: PrefixRecord) -> dict[str, int]:
    return {state_type.name: len(buffers) for state_type, buffers in rec.pages.items()}


@contextlib.contextmanager
def opened(path: Path, fingerprint: dict[str, Any]) -> Iterator[tuple[int, Iterator[PrefixRecord]]]:
    """A file written under `fingerprint`: its record count, and its records, each read from the file
    when the iteration reaches it (an import holds one record in host memory at a time, and one that
    stops when the pools are full reads no further). ValueError naming what differs otherwise."""
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
        yield len(index), (_decode(f.get_tensor, i, entry) for i, entry in enumerate(index))


def _decode(get: Callable[[str], torch.Tensor], i: int, entry: dict[str, Any]) -> PrefixRecord:
    """Record i of a file or packed blob (`contents`' names; `get` reads a tensor by name)."""
    pages = {
        StateType[name]: [get(f"{i}.{name}.{b}") for b in range(count)]
        for name, count in entry["buffers"].items()
    }
    extra = {k: get(f"{i}.extra.{k}") for k in entry.get("extra", [])}
    return PrefixRecord(tuple(get(f"{i}.tokens").tolist()), int(entry["base"]), pages, extra)


def pack(records: list[PrefixRecord], fingerprint: dict[str, Any]) -> bytes:
    """Records as a file's bytes, for a peer server (server/prefix_peers.py)."""
    from safetensors.torch import save

    tensors, meta = contents(records, fingerprint)
    return save({k: t.contiguous() for k, t in tensors.items()}, metadata=meta)


def unpack(blob: bytes, fingerprint: dict[str, Any]) -> list[PrefixRecord]:
    """What `pack` made under `fingerprint`; ValueError naming what differs or is damaged otherwise."""
    from safetensors.torch import load

    from dsv4_engine.disagg.fingerprint import fingerprint_diff

    try:
        (size,) = struct.unpack("<Q", blob[:8])  # safetensors: the header's length, then the header
        meta = json.loads(blob[8 : 8 + size]).get("__metadata__") or {}
        theirs, index = json.loads(meta["fingerprint"]), json.loads(meta["records"])
        tensors = load(blob)
    except Exception as exc:  # short, not JSON, no metadata, or safetensors' own error
        raise ValueError(f"not prefix-cache records: {exc!r}") from exc
    diff = fingerprint_diff(fingerprint, theirs)
    if diff is not None:
        raise ValueError(f"records of a server of another layout: {diff}")
    try:
        return [_decode(tensors.__getitem__, i, entry) for i, entry in enumerate(index)]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"damaged prefix-cache records: {exc!r}") from exc


def read(path: Path, fingerprint: dict[str, Any]) -> list[PrefixRecord]:
    """Every record of a file written under `fingerprint` (`opened`)."""
    with opened(path, fingerprint) as (_, records):
        return list(records)


def _mtime(path: Path) -> float | None:
    """When the file was last modified; None once it is gone (another server may remove it)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def make_room(
    directory: Path, own: Path, needed: int, live_since: float,
    free: Callable[[Path], int] = lambda d: shutil.disk_usage(d).free,
) -> list[Path]:  # fmt: skip
    """Remove other servers' files from `directory`, oldest first, until `needed` bytes are free beside
    `own` (which stays until its replacement is renamed over it); returns those removed. A server scaled
    away or renamed leaves its file, and on a volume of fixed size such files would in the end leave no
    room for the servers still running. A file modified since `live_since` is a running server's (each
    touches its own every interval, changed or not) and is kept, as are temporary files being written."""
    if free(directory) >= needed:
        return []
    candidates = [p for p in directory.glob(f"{FILE_STEM}*.safetensors") if p != own]
    candidates += list(directory.glob(f".{FILE_STEM}*.tmp"))  # a killed writer's
    aged = sorted((m, p) for p in candidates if (m := _mtime(p)) is not None and m < live_since)
    removed = []
    for _, path in aged:
        if free(directory) >= needed:
            break
        with contextlib.suppress(OSError):  # removed meanwhile (another server made room too)
            path.unlink()
            removed.append(path)
    return removed


async def server_fingerprint(ctx: ServerContext) -> dict[str, Any]:
    """This server's layout fingerprint, computed once (a PD server's setup did already)."""
    if ctx.fingerprint is None:
        from dsv4_engine.disagg.checkpoint import checkpoint_digest
        from dsv4_engine.disagg.fingerprint import layout_fingerprint

        engine = ctx.engine
        digest = await asyncio.to_thread(checkpoint_digest, ctx.settings.model)
        ctx.fingerprint = layout_fingerprint(engine.layout, engine.kv_pool.pd_state_components(), digest)
    return ctx.fingerprint


def file_name(owner: str) -> str:
    """The file a server named `owner` writes (`owner_name`)."""
    return f"{FILE_STEM}-{re.sub(r'[^A-Za-z0-9._-]', '_', owner)}.safetensors"


def owner_name(port: int, env: Mapping[str, str] = os.environ) -> str:
    """This server's name for its file: its pod's name (POD_NAME, which the operator's pods carry: a
    StatefulSet pod keeps it across restarts, and on the host network the hostname is the node's), or
    the hostname; and its port, by which local servers differ."""
    return f"{env.get('POD_NAME') or socket.gethostname()}-{port}"


class PrefixCacheFile:
    """A server's --prefix-cache-dir: imported at start, then saved every `--prefix-cache-save-interval`
    seconds while the server serves (when the cache changed; so a crash loses at most an interval),
    and once more after a drain. Each server writes a file of its own, so servers sharing DIR (a
    Dsv4Deployment's prefill replicas on one claim) never overwrite each other; a starting server
    imports its own file first, then the others', newest first, while its pools have room. The one
    writer of its file for this process: saves never overlap."""

    def __init__(self, ctx: ServerContext) -> None:
        settings = ctx.settings
        assert settings.prefix_cache_dir is not None
        self.ctx = ctx
        self.dir = Path(settings.prefix_cache_dir)
        self.path = self.dir / file_name(owner_name(settings.port))
        self.interval = settings.prefix_cache_save_interval
        self.max_bytes = settings.prefix_cache_max_bytes
        self.fingerprint: dict[str, Any] | None = None
        # The cache's change count the directory reflects: the file holds it (`wrote`), or it had
        # nothing to write (empty, or no prefix under the cap) and the file was left as it was.
        self.saved_version: int | None = None
        self.wrote = False
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._saver: asyncio.Task[None] | None = None

    def files(self) -> list[Path]:
        """The files to import: this server's, then the others' (every server's that shared DIR, and
        an older version's single file), newest first (one removed meanwhile last: its import says so)."""
        others = [p for p in self.dir.glob(f"{FILE_STEM}*.safetensors") if p != self.path]
        others.sort(key=lambda p: _mtime(p) or 0.0, reverse=True)
        return [self.path, *others] if self.path.exists() else others

    async def restore(self) -> None:
        """At start, before ready: import the files written under this layout, while pools have room."""
        ctx = self.ctx
        assert ctx.bridge is not None
        self.fingerprint = await server_fingerprint(ctx)
        fingerprint = self.fingerprint
        files = self.files()
        if not files:
            log.info("prefix cache: no %s* in %s yet; starting cold", FILE_STEM, self.dir)
            return
        imported, own_version = 0, None
        for path in files:
            started = time.monotonic()

            def load(engine: Any, path: Path = path) -> tuple[int, int, int, str | None]:
                before = engine.metrics()["prefix_cache_snapshots"]
                count, error = 0, None
                try:
                    with opened(path, fingerprint) as (count, records):
                        engine.import_prefix_cache(records)
                # Unreadable, another layout's, a damaged record: the records before it stay cached.
                except Exception as exc:
                    error = str(exc)
                done = int(engine.metrics()["prefix_cache_snapshots"] - before)
                return count, done, engine.prefix_cache_version(), error

            count, done, version, error = await ctx.bridge.run(load)
            imported += done
            if error is not None:
                log.warning("prefix cache: %s: %s (imported %d prefixes before it)", path.name, error, done)
                continue
            log.info(
                "prefix cache: imported %d of %d prefixes from %s in %.2fs",
                done, count, path, time.monotonic() - started,
            )  # fmt: skip
            if path == self.path and done == count:
                own_version = version
            elif done and own_version is not None:
                own_version = None  # the cache holds more than this server's file
        self.saved_version = own_version  # the file holds what the cache holds: no save until it changes
        self.wrote = own_version is not None
        ctx.metrics.prefix_imported.set(imported)

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

    def _store(self, records: list[PrefixRecord]) -> list[Path]:
        """Write the file, first removing files of servers gone if the volume lacks room (`make_room`)."""
        assert self.fingerprint is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        live_since = time.time() - 2 * self.interval - LIVE_GRACE_SECONDS
        file = contents(records, self.fingerprint)
        removed = make_room(self.dir, self.path, file_bytes(file), live_since)
        write(self.path, file)
        return removed

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
            # Removed (by hand, or by another server making room): written again even if unchanged.
            exists = await asyncio.to_thread(self.path.exists)
            saved = self.saved_version if exists or not self.wrote else None

            def begin(engine: Any) -> tuple[int, PrefixExporter | None]:
                version = engine.prefix_cache_version()
                return version, None if version == saved else engine.prefix_exporter(cap)

            # While serving, the read goes a part at a time between steps (SAVE_PART_SECONDS each);
            # after a drain nothing runs, so it goes at once.
            budget = SAVE_PART_SECONDS if serving else None
            try:
                version, exporter = await ctx.bridge.run(begin)
                if exporter is None:  # settled: the file is touched, so others see this server runs
                    if exists:
                        await asyncio.to_thread(os.utime, self.path)
                    return
                parts = 1
                while not await ctx.bridge.run(lambda _: exporter.read(budget)):
                    parts += 1
                got = exporter.result()
                if got.busy and serving:
                    log.info("prefix cache: %d prefixes busy; saving at the next interval", got.busy)
                    return
                if not got.records:  # settled until the cache changes
                    why = "no prefix fits --prefix-cache-max-bytes" if got.over_cap else "empty"
                    log.info("prefix cache: %s, %s left as it is", why, self.path)
                    self.saved_version, self.wrote = version, False
                    return
                removed = await asyncio.to_thread(self._store, got.records)
            except (OSError, ValueError, RuntimeError) as exc:
                log.warning("prefix cache: not saved: %s", exc)
                return
            for gone in removed:
                log.warning("prefix cache: removed %s, unchanged for 2 intervals, to make room", gone.name)
            self.saved_version, self.wrote = version, True
            ctx.metrics.prefix_saved.set(len(got.records))
            ctx.metrics.prefix_saved_at.set(time.time())
            left = [f"{got.over_cap} over --prefix-cache-max-bytes"] if got.over_cap else []
            left += [f"{got.gone} dropped by the cache meanwhile"] if got.gone else []
            log.info(
                "prefix cache: saved %d prefixes to %s in %.2fs (read between steps in %d part(s), the "
                "longest %.3fs)%s",
                len(got.records), self.path, time.monotonic() - started, parts, exporter.longest_part_s,
                f"; left out: {', '.join(left)}" if left else "",
            )  # fmt: skip
