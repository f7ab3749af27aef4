"""Active/standby with a coordination.k8s.io Lease.

kopf's peering pauses every operator of equal priority when it sees another, so it elects nobody.
Here every replica runs kopf and serves the admission webhook (validation is stateless, so standby
replicas keep admission available), but only the replica holding the Lease reconciles. A standby
takes over once the holder stops renewing for `duration` seconds, or at once when the holder releases
the Lease on a clean shutdown.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any

from .kube import Api, ApiError

logger = logging.getLogger(__name__)
API_VERSION = "coordination.k8s.io/v1"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _fmt(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(s: str | None) -> datetime.datetime | None:
    if not s:
        return None
    return datetime.datetime.fromisoformat(s.replace("Z", "+00:00"))


def claimable(spec: Mapping[str, Any], identity: str, now: datetime.datetime) -> bool:
    """Ours already, unheld, or not renewed within its duration."""
    holder = spec.get("holderIdentity")
    renewed = _parse(spec.get("renewTime"))
    duration = datetime.timedelta(seconds=spec.get("leaseDurationSeconds") or 15)
    return not holder or holder == identity or renewed is None or renewed + duration < now


def claim(lease: Mapping[str, Any], identity: str, duration: float, now: datetime.datetime) -> dict[str, Any]:
    spec = dict(lease.get("spec") or {})
    if spec.get("holderIdentity") != identity:
        spec["acquireTime"] = _fmt(now)
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
    spec.update(holderIdentity=identity, renewTime=_fmt(now), leaseDurationSeconds=int(duration))
    return {**lease, "spec": spec}


class Lease:
    def __init__(
        self, api: Api, namespace: str, name: str, identity: str, duration: float = 15.0,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:  # fmt: skip
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.duration = duration
        self.leader = False
        self._on_change = on_change or (lambda leader: None)

    def _set(self, leader: bool) -> None:
        if leader != self.leader:
            logger.info("lease %s/%s: %s", self.namespace, self.name, "acquired" if leader else "lost")
            self.leader = leader
            self._on_change(leader)

    async def try_once(self) -> bool:
        lease = await self.api.get(API_VERSION, "Lease", self.namespace, self.name)
        now = _now()
        try:
            if lease is None:
                fresh = {"apiVersion": API_VERSION, "kind": "Lease",
                         "metadata": {"name": self.name, "namespace": self.namespace}}  # fmt: skip
                await self.api.create(claim(fresh, self.identity, self.duration, now))
                return True
            if not claimable(lease.get("spec") or {}, self.identity, now):
                return False
            await self.api.replace(claim(lease, self.identity, self.duration, now))
            return True
        except ApiError as e:
            if e.status == 409:  # another replica wrote first
                return False
            raise

    async def run(self) -> None:
        """Acquire, then renew every third of the duration; give up leading when renewal fails."""
        last_ok = _now()
        while True:
            try:
                held = await self.try_once()
                last_ok = _now()
                self._set(held)
            except (TimeoutError, ApiError, OSError) as e:
                logger.warning("lease %s/%s: %s", self.namespace, self.name, e)
                if (_now() - last_ok).total_seconds() > self.duration * 2 / 3:
                    self._set(False)
            await asyncio.sleep(self.duration / 3)

    async def release(self) -> None:
        if not self.leader:
            return
        self._set(False)
        lease = await self.api.get(API_VERSION, "Lease", self.namespace, self.name)
        if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
            lease["spec"]["holderIdentity"] = None
            try:
                await self.api.replace(lease)
            except ApiError as e:
                logger.warning("lease release: %s", e)
