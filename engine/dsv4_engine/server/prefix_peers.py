"""`dsv4 serve --prefix-cache-peers URL[,URL...]`: servers of one deployment share their prefix caches.

Why: a prefix cache pays off only where a conversation's turns meet the server that cached the turn
before. A router that keeps them together does that; one that does not (sglang-router 0.3.2 picks
a PD prefill server at random whatever its policy: operator/dsv4_operator/plan.py) sends a chat's next
turn to a server that never saw it, and with 2 prefill servers half the turns prefill their whole
history again. With peers, a server that is about to prefill more than a page its own cache lacks
first asks the others how far their caches could resume the prompt (`POST /prefix_cache/lookup`,
answered from the cache's hash index without waiting for the engine: `PrefixCache.resumable_length`),
then fetches the pages it lacks from the one that could resume furthest (`POST /prefix_cache/fetch`:
read between two of that server's steps, as a prefix-cache file's record, behind the layout
fingerprint: prefix_file.pack) and caches them just ahead of the request, in the same gap between
two of its own steps (evicting its least recently used prefixes if it must). The request then
resumes there as from its own cache, with identical state: a record is what a request resuming at
its end reads.

A URL whose host resolves to several addresses means all of them (a role's headless Service: every
ready pod), resolved again every RESOLVE_SECONDS; this server's own address and port is left out, so
every server of a role can be given the same list. A peer that fails, stalls or differs in layout
costs the request at most --prefix-cache-peer-timeout seconds, and it prefills as it would alone.
Requests for the same prefix share one fetch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from dsv4_engine.memory.prefix_store import PrefixRecord
from dsv4_engine.server.errors import ApiError, bad_request
from dsv4_engine.server.prefix_file import pack, server_fingerprint, unpack
from dsv4_engine.server.state import ServerContext

log = logging.getLogger("dsv4.server")

RESOLVE_SECONDS = 10.0  # how long a resolution of the peers' names stands (pods come and go)
BLOB_TYPE = "application/vnd.dsv4.prefix-records+safetensors"


class LookupBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_ids: list[int]


class FetchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_ids: list[int]
    base: int = Field(ge=0)  # where the asking server resumes already: it wants the pages from there
    fingerprint: dict[str, Any]  # the asking server's layout fingerprint


def _own_address(host: str) -> bool:
    """Whether host (an IP address) is one of this machine's: only those can be bound."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class PrefixPeers:
    """This server's side of the sharing: whom to ask, and the fetches under way."""

    def __init__(self, ctx: ServerContext, urls: list[str], timeout: float) -> None:
        self.ctx, self.urls, self.timeout = ctx, urls, timeout
        self._client: httpx.AsyncClient | None = None
        self._resolved: list[str] = []
        self._resolved_at = -RESOLVE_SECONDS
        self._fetches: dict[tuple[int, ...], asyncio.Task[list[PrefixRecord]]] = {}  # by the prefix fetched

    async def start(self) -> None:
        """Once the engine is loaded: the fingerprint peers' records must match (on the context), and
        the client."""
        await server_fingerprint(self.ctx)
        key = self.ctx.settings.api_key  # peers run with the same settings: the same key, if any
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=self.timeout)

    async def close(self) -> None:
        for task in list(self._fetches.values()):
            task.cancel()
        if self._client is not None:
            await self._client.aclose()

    async def peers(self) -> list[str]:
        """The peers' base URLs: every address of every URL's host but this server's own."""
        now = time.monotonic()
        if now - self._resolved_at < RESOLVE_SECONDS:
            return self._resolved
        loop, own_port, found = asyncio.get_running_loop(), self.ctx.settings.port, []
        for url in self.urls:
            parts = urlsplit(url)
            host, port = parts.hostname or "", parts.port or 80
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("prefix cache peers: cannot resolve %s: %s", url, exc)
                continue
            for addr in dict.fromkeys(str(info[4][0]) for info in infos):
                if not (port == own_port and _own_address(addr)):
                    found.append(_url(addr, port))
        self._resolved, self._resolved_at = list(dict.fromkeys(found)), now
        return self._resolved

    async def fetch(self, prompts: list[list[int]]) -> list[PrefixRecord]:
        """Before the prompts start: the records of what peers' caches resume further than this
        server's (`cache` them next). Never raises (but cancellation); bounded by the timeout."""
        try:
            async with asyncio.timeout(self.timeout):
                found = await asyncio.gather(*(self._fetch_for(p) for p in prompts))
        except TimeoutError:
            self.ctx.metrics.peer_fetches.labels("failed").inc()
            log.warning("prefix cache peers: no answer in %.1fs; prefilling without", self.timeout)
            return []
        except Exception:  # a fetch only saves work: whatever went wrong, the request prefills here
            self.ctx.metrics.peer_fetches.labels("failed").inc()
            log.exception("prefix cache peers: fetch failed; prefilling without")
            return []
        return [rec for records in found for rec in records]

    def cache(self, records: list[PrefixRecord]) -> None:
        """Queue the records' import on the engine thread, evicting if it must. The engine applies
        queued commands in order between two steps, so a request added right after this finds them
        cached in the same gap (awaiting the import first would cost it a step)."""
        bridge = self.ctx.bridge
        if not records or bridge is None:
            return
        metrics = self.ctx.metrics

        def done(future: concurrent.futures.Future[int]) -> None:  # on the engine thread
            try:
                count = future.result()
            except Exception as exc:  # the engine died; a record this layout refuses
                log.warning("prefix cache peers: fetched prefixes not cached: %s", exc)
                return
            metrics.peer_tokens.inc(sum(len(r.tokens) - r.base for r in records[:count]))

        bridge.call(lambda engine: engine.import_prefix_cache(records, evict=True)).add_done_callback(done)

    async def _fetch_for(self, prompt: list[int]) -> list[PrefixRecord]:
        ctx, engine = self.ctx, self.ctx.engine
        page = engine.layout.page_size
        have = engine.resumable_length(prompt)
        if len(prompt) - have < page or self._client is None:
            return []
        peers = await self.peers()
        if not peers:
            return []
        aligned = prompt[: len(prompt) // page * page]  # a cache resumes at page boundaries only
        lengths = await asyncio.gather(*(self._lookup(url, aligned) for url in peers))
        best, url = max(zip(lengths, peers, strict=True))
        if best <= have:
            ctx.metrics.peer_fetches.labels("none").inc()
            return []
        key = tuple(prompt[:best])
        task = self._fetches.get(key)
        if task is None:
            task = self._fetches[key] = asyncio.create_task(self._fetch(url, prompt[:best], have))
            task.add_done_callback(lambda _: self._fetches.pop(key, None))
        # Shielded: another request may wait on the same fetch when this one's client leaves.
        records = await asyncio.shield(task)
        ctx.metrics.peer_fetches.labels("fetched" if records else "failed").inc()
        return records

    async def _lookup(self, url: str, prompt: list[int]) -> int:
        assert self._client is not None
        try:
            r = await self._client.post(f"{url}/prefix_cache/lookup", json={"input_ids": prompt})
            r.raise_for_status()
            return int(r.json()["length"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("prefix cache peers: %s: lookup failed: %r", url, exc)
            return 0

    async def _fetch(self, url: str, tokens: list[int], base: int) -> list[PrefixRecord]:
        """The record of the prefix of tokens that the peer at url resumes at, with its pages from base
        on ([]: the peer no longer had it, or failed)."""
        fingerprint = self.ctx.fingerprint
        assert self._client is not None and fingerprint is not None
        body = {"input_ids": tokens, "base": base, "fingerprint": fingerprint}
        started = time.monotonic()
        try:
            r = await self._client.post(f"{url}/prefix_cache/fetch", json=body)
            if r.status_code == 204:  # evicted there since the lookup
                return []
            r.raise_for_status()
            records = unpack(r.content, fingerprint)
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("prefix cache peers: %s: fetch failed: %r", url, exc)
            return []
        log.info(
            "prefix cache peers: fetched tokens %d to %d from %s, %d bytes in %.3fs",
            base, len(tokens), url, len(r.content), time.monotonic() - started,
        )  # fmt: skip
        return records


# ---- the routes peers call ----------------------------------------------------------------------
router = APIRouter()


def _ready(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    ctx.require_ready()
    return ctx


@router.post("/prefix_cache/lookup")
async def lookup(request: Request, body: LookupBody) -> dict[str, int]:
    """How long a prefix of input_ids this server's cache could resume at: from the cache's hash index,
    not the engine thread, so asking costs the peer nothing while it steps."""
    ctx = _ready(request)
    return {"length": ctx.engine.resumable_length(body.input_ids)}


@router.post("/prefix_cache/fetch")
async def fetch(request: Request, body: FetchBody) -> Response:
    """The longest prefix of input_ids this server's cache resumes at, as a record of its pages from
    `base` on (prefix_file.pack); 204 when it resumes no further than base (evicted since a lookup),
    409 when the asking server's layout differs (naming the field)."""
    from dsv4_engine.disagg.fingerprint import fingerprint_diff

    ctx = _ready(request)
    page = ctx.engine.layout.page_size
    if body.base % page:
        raise bad_request(f"base must be a multiple of the page size {page}", param="base")
    mine = await server_fingerprint(ctx)
    diff = fingerprint_diff(mine, body.fingerprint)
    if diff is not None:
        raise ApiError(
            409, f"this server's layout differs: {diff}", param="fingerprint", code="layout_mismatch"
        )
    ids, base = body.input_ids, body.base
    record = await ctx.run_engine(lambda engine: engine.export_prefix(ids, base))
    if record is None:
        return Response(status_code=204)
    blob = await asyncio.to_thread(pack, [record], mine)
    ctx.metrics.peer_exports.inc()
    return Response(blob, media_type=BLOB_TYPE)
