"""The decode side's connections to prefill servers' bootstrap endpoints (bootstrap.py).

One per prefill address: `/route` once (layout fingerprint compared: a mismatch fails the request
naming the field), this server's session registered once (destination pointers), then a heartbeat
on its /health that declares the prefill dead after --disaggregation-heartbeat-failures misses.
A dead peer fails the rooms waiting on it and is dropped: the next request connects afresh.

A prefill restarted on the same address faster than the heartbeat notices answers with a new
instance id (its /route and /health carry one per process): the heartbeat drops the old peer, and
a claim it refuses as an unknown session (or a session it blacklisted after a failed write) makes
this server register again and claim once more, so a restart or a stall costs at most the requests
it caught, never every later one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from dsv4_engine.disagg.base import PdMetrics
from dsv4_engine.disagg.fingerprint import fingerprint_diff
from dsv4_engine.disagg.protocol import PdError, PdTarget

log = logging.getLogger("dsv4.pd.decode")

HEARTBEAT_TIMEOUT = 5.0  # seconds one health check of a prefill's bootstrap endpoint may take


@dataclass
class PrefillPeer:
    address: str
    client: httpx.AsyncClient
    fingerprint: dict[str, Any] | None = None
    instance: str | None = None  # the prefill process this server registered with
    dead: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    heartbeat: asyncio.Task[None] | None = None
    ready: asyncio.Future[None] | None = None


class PrefillPeers:
    def __init__(
        self,
        decode_id: str,
        session: dict[str, Any],
        *,
        fingerprint: dict[str, Any],
        heartbeat_interval: float,
        heartbeat_failures: int,
        metrics: PdMetrics,
        draft: dict[str, Any] | None = None,
    ) -> None:
        self.decode_id = decode_id
        self.session = session  # the body of PUT /sessions/{decode_id}: pointers and fingerprint
        self.draft = draft  # this server's MTP window slots: {"ptr", "offer"} (speculating only)
        self.fingerprint = fingerprint
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_failures = heartbeat_failures
        self.metrics = metrics
        self.peers: dict[str, PrefillPeer] = {}

    async def get(self, target: PdTarget) -> PrefillPeer:
        """The live, paired peer at the target's address (connecting once); raises PdError."""
        peer = self.peers.get(target.address)
        if peer is not None and peer.dead.is_set():
            self.peers.pop(target.address, None)
            peer = None
        if peer is None:
            client = httpx.AsyncClient(base_url=f"http://{target.address}", timeout=httpx.Timeout(10.0))
            peer = PrefillPeer(target.address, client)
            peer.ready = asyncio.ensure_future(self._connect(peer))
            self.peers[target.address] = peer
        assert peer.ready is not None
        try:
            await asyncio.shield(peer.ready)
        except PdError:
            if self.peers.get(target.address) is peer:
                del self.peers[target.address]
            raise
        return peer

    async def _connect(self, peer: PrefillPeer) -> None:
        started = time.monotonic()
        await self._register(peer)
        self.metrics.pd_handshake_seconds.observe(time.monotonic() - started)
        peer.heartbeat = asyncio.ensure_future(self._heartbeat(peer))

    async def _register(self, peer: PrefillPeer) -> None:
        """GET /route (fingerprint compared) and PUT this server's session, at the instance now there."""
        try:
            route = (await peer.client.get("/route")).json()
            diff = fingerprint_diff(self.fingerprint, route["fingerprint"])
            if diff is not None:
                raise PdError("layout_mismatch", f"decode refuses prefill {peer.address}: {diff}")
            if "ranks" in self.session and "ranks" not in route:
                # Each rank here takes its state from a prefill rank of its own (lanes.py); a prefill
                # from before per-rank transfer would write rank 0 only and the others would decode
                # from pages nobody wrote. (A one-rank decode pairs with either.)
                raise PdError(
                    "layout_mismatch",
                    f"decode refuses prefill {peer.address}: this decode server has "
                    f"{1 + len(self.session['ranks'])} ranks, each written by a prefill rank of its own, "
                    "and the prefill predates per-rank transfer (no 'ranks' in its /route): upgrade it",
                )
            body = self.session
            if self.draft is not None and route.get("draft_window") == self.draft["offer"]:
                body = {**body, "draft_ptr": self.draft["ptr"]}  # only to a prefill that offered it
            r = await peer.client.put(f"/sessions/{self.decode_id}", json=body)
            if r.status_code != 200:
                raise PdError.from_body(r.json())
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise PdError(
                "bootstrap_unreachable", f"prefill bootstrap {peer.address} unreachable: {exc}"
            ) from exc
        peer.fingerprint, peer.instance = route["fingerprint"], route.get("instance")

    async def _heartbeat(self, peer: PrefillPeer) -> None:
        misses = 0
        while not peer.dead.is_set():
            await asyncio.sleep(self.heartbeat_interval)
            try:
                # A check waits at least HEARTBEAT_TIMEOUT: a busy prefill answers late, not never.
                r = await peer.client.get("/health", timeout=max(self.heartbeat_interval, HEARTBEAT_TIMEOUT))
                misses = 0 if r.status_code == 200 else misses + 1
                instance = r.json().get("instance") if r.status_code == 200 else peer.instance
            except (httpx.HTTPError, ValueError):
                misses, instance = misses + 1, peer.instance
            if instance != peer.instance:  # restarted: its rooms and our session died with the old one
                self.declare_dead(peer, f"prefill instance {peer.address} restarted")
                return
            if misses >= self.heartbeat_failures:
                self.declare_dead(peer, f"Lost connection with prefill instance {peer.address}")

    def declare_dead(self, peer: PrefillPeer, reason: str) -> None:
        if peer.dead.is_set():
            return
        log.warning("%s: failing its rooms", reason)
        peer.reason = reason
        peer.dead.set()
        if self.peers.get(peer.address) is peer:
            del self.peers[peer.address]

    async def claim(self, peer: PrefillPeer, target: PdTarget, digest: str) -> None:
        """PUT /rooms/{room}: this server takes the room (renewed while it queues for pages). A prefill
        that does not know this server's session (restarted) or blacklisted it (a write to it failed)
        gets it registered again, and the claim is made once more."""
        try:
            await self._claim(peer, target, digest)
        except PdError as err:
            if err.reason not in ("unknown_session", "peer_dead"):
                raise
            log.info("prefill %s answered %s: registering again", peer.address, err.reason)
            await self._register(peer)
            await self._claim(peer, target, digest)

    async def _claim(self, peer: PrefillPeer, target: PdTarget, digest: str) -> None:
        try:
            r = await peer.client.put(
                f"/rooms/{target.room}", json={"decode_id": self.decode_id, "prompt_digest": digest}
            )
        except httpx.HTTPError as exc:
            raise PdError(
                "bootstrap_unreachable", f"claiming room {target.room} at {peer.address}: {exc}"
            ) from exc
        if r.status_code != 200:
            raise PdError.from_body(r.json())

    async def delete(self, target: PdTarget, reason: str, message: str) -> bool:
        """DELETE the room at its prefill; True if a write may still land (or nobody answered)."""
        body = {"decode_id": self.decode_id, "reason": reason, "message": message}
        peer = self.peers.get(target.address)
        try:
            if peer is not None and not peer.dead.is_set():
                r = await peer.client.request("DELETE", f"/rooms/{target.room}", json=body, timeout=5.0)
            else:
                async with httpx.AsyncClient(base_url=f"http://{target.address}", timeout=5.0) as client:
                    r = await client.request("DELETE", f"/rooms/{target.room}", json=body)
            return bool(r.json().get("writing", True))
        except (httpx.HTTPError, ValueError) as exc:
            log.info("could not abort room %d at %s: %r", target.room, target.address, exc)
            return True

    async def may_land(self, target: PdTarget) -> bool | None:
        """Whether a write of the room may still land here, as its prefill says; None when it does
        not answer (stalled, unreachable, gone)."""
        url = f"http://{target.address}/rooms/{target.room}"
        try:
            async with httpx.AsyncClient(timeout=HEARTBEAT_TIMEOUT) as client:
                r = await client.get(url, params={"decode_id": self.decode_id})
            return bool(r.json()["may_land"]) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    async def close(self) -> None:
        for peer in list(self.peers.values()):
            if peer.heartbeat is not None:
                peer.heartbeat.cancel()
            await peer.client.aclose()
        self.peers.clear()
