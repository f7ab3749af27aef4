"""A small async Kubernetes client for the reconciler: get, list, server-side apply, delete, status.

kopf talks to the API with its own aiohttp session but exposes no client to handlers; this one is
built from the same `kopf.ConnectionInfo` the login handler obtains, so both speak with one identity.
Every write goes through `_write`, which counts it (the operator's metrics show writes per verb).
"""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import kopf

FIELD_MANAGER = "dsv4-operator"
# How long "this API server does not serve that group/version" is believed before asking again.
UNSERVED_TTL_S = 300.0

Obj = dict[str, Any]


class ApiError(Exception):
    """A non-2xx answer; `status` is the HTTP code, `message` the API's own words."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def plural(kind: str) -> str:
    low = kind.lower()
    if low.endswith("y"):
        return low[:-1] + "ies"
    return low + ("es" if low.endswith("s") else "s")


def path(api_version: str, kind: str, namespace: str | None, name: str | None = None, sub: str = "") -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    tail = f"/{name}" if name else ""
    return f"{base}{ns}/{plural(kind)}{tail}{'/' + sub if sub else ''}"


def object_path(obj: Mapping[str, Any], sub: str = "") -> str:
    meta = obj["metadata"]
    return path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], sub)


def selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def matches(obj: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


class Api:
    """One aiohttp session per operator process; `on_write(verb, kind)` observes every write."""

    def __init__(self, on_write: Callable[[str, str], None] | None = None, max_inflight: int = 32) -> None:
        self._info: kopf.ConnectionInfo | None = None
        # Client-side flow control (as client-go's QPS/burst): a burst of reconciles must not turn
        # into thousands of concurrent requests that the API server answers with 429.
        self._inflight = asyncio.Semaphore(max_inflight)
        self._limit = max_inflight
        self._session: aiohttp.ClientSession | None = None
        self._on_write = on_write or (lambda verb, kind: None)
        self._served: dict[str, tuple[bool, float]] = {}  # version -> (served, when asked)

    def use(self, info: kopf.ConnectionInfo) -> None:
        self._info = info

    @property
    def info(self) -> kopf.ConnectionInfo:
        if self._info is None:
            raise kopf.TemporaryError("no Kubernetes credentials yet", delay=1)
        return self._info

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _ensure(self) -> tuple[aiohttp.ClientSession, str]:
        if self._info is None:
            raise kopf.TemporaryError("no Kubernetes credentials yet (login has not run)", delay=1)
        if self._session is None or self._session.closed:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                auth = self._info.as_aiohttp_basic_auth()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._info.as_ssl_context(), limit=self._limit),
                headers={**self._info.as_http_headers(), "User-Agent": FIELD_MANAGER},
                auth=auth,
                timeout=aiohttp.ClientTimeout(total=30),
            )
        return self._session, self._info.server.rstrip("/")

    async def _call(
        self,
        method: str,
        url: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        session, server = self._ensure()
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        async with (
            self._inflight,
            session.request(method, server + url, data=data, params=params, headers=headers) as resp,
        ):
            text = await resp.text()
            if resp.status >= 400:
                try:
                    payload = json.loads(text)
                    raise ApiError(resp.status, payload.get("reason", ""), payload.get("message", text))
                except ValueError:
                    raise ApiError(resp.status, resp.reason or "", text) from None
            return json.loads(text) if text else None

    async def _write(self, verb: str, kind: str, method: str, url: str, **kw: Any) -> Any:
        self._on_write(verb, kind)
        return await self._call(method, url, **kw)

    async def serves(self, api_version: str) -> bool:
        """Whether the cluster serves this group/version. A yes is cached (a version rarely goes
        away); a no for `UNSERVED_TTL_S`, so CRDs installed later (the Prometheus Operator's) are
        found without a restart."""
        served = self._served.get(api_version)
        if served is None or (not served[0] and time.monotonic() - served[1] > UNSERVED_TTL_S):
            url = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
            try:
                await self._call("GET", url)
                served = (True, time.monotonic())
            except ApiError as e:
                if e.status != 404:
                    raise
                served = (False, time.monotonic())
            self._served[api_version] = served
        return served[0]

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Obj | None:
        try:
            return await self._call("GET", path(api_version, kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> list[Obj]:
        try:
            got = await self._call(
                "GET", path(api_version, kind, namespace), params={"labelSelector": selector(labels)}
            )
        except ApiError as e:
            if e.status == 404:  # the kind is not served by this cluster: nothing of it can exist
                return []
            raise
        items = got.get("items") or []
        for item in items:  # list items carry no apiVersion/kind
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return [i for i in items if matches(i, labels)]  # servers filter; emulators may not

    async def apply(self, obj: Mapping[str, Any]) -> Obj:
        """Server-side apply under the one field manager; force takes fields over from hand edits."""
        return await self._write(
            "apply", obj["kind"], "PATCH", object_path(obj), body=obj,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )  # fmt: skip

    async def delete(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        body: Obj = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if meta.get("uid"):  # never delete a same-named successor
            body["preconditions"] = {"uid": meta["uid"]}
        try:
            await self._write("delete", obj["kind"], "DELETE", object_path(obj), body=body)
        except ApiError as e:
            if e.status not in (404, 409):
                raise

    async def patch_status(self, obj: Mapping[str, Any], status: Mapping[str, Any]) -> Obj:
        return await self._write(
            "patch", obj["kind"], "PATCH", object_path(obj, "status"), body={"status": status},
            content_type="application/merge-patch+json",
        )  # fmt: skip

    async def merge_patch(self, obj: Mapping[str, Any], patch: Mapping[str, Any]) -> Obj:
        """A JSON merge patch of `obj` (lists in it replace the object's whole lists)."""
        return await self._write(
            "patch", obj["kind"], "PATCH", object_path(obj), body=patch,
            content_type="application/merge-patch+json",
        )  # fmt: skip

    async def create(self, obj: Mapping[str, Any]) -> Obj:
        meta = obj["metadata"]
        url = path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        return await self._write("create", obj["kind"], "POST", url, body=obj)

    async def replace(self, obj: Mapping[str, Any]) -> Obj:
        """PUT with the object's resourceVersion: fails with 409 if someone wrote in between."""
        return await self._write("update", obj["kind"], "PUT", object_path(obj), body=obj)
