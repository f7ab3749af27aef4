"""One level-triggered reconcile of a Dsv4Deployment: read what is live, decide the serving generation,
apply what differs, delete what left the plan, write status only when it changed.

A resync that finds everything as rendered sends no write request at all.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from . import apply as ap
from . import metrics
from . import status as st
from .kube import Api, ApiError

Obj = dict[str, Any]
EventFn = Callable[[str, str, str], None]  # (type, reason, message)


# On the endpoint Service once the endpoint has moved: "<previous fingerprint> <unix time>", the time
# until which that generation is kept. Clients and proxies still send to the old router for a moment
# after the Service's selector changes (Endpoints and kube-proxy lag); deleting the old generation at
# once fails those requests (its router loses its workers first: "No prefill workers available").
DRAIN_ANNOTATION = "dsv4.ai/draining"


@dataclass
class Outcome:
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    status_written: bool = False
    error: st.Problem | None = None
    recheck_in: float | None = None  # seconds until a kept generation's drain ends

    @property
    def writes(self) -> int:
        return len(self.applied) + len(self.deleted) + int(self.status_written)


def draining(endpoint: Obj | None, previous: str | None, serving: str, now: float, drain_seconds: float
             ) -> tuple[str, float] | None:  # fmt: skip
    """(generation, until) the endpoint last moved away from: a move now starts the drain; else the
    one the endpoint Service records (kept after it ends, so the Service's content stays the same)."""
    if previous and previous != serving:
        return previous, now + drain_seconds
    note = ((endpoint or {}).get("metadata", {}).get("annotations") or {}).get(DRAIN_ANNOTATION, "")
    fp, _, until = note.partition(" ")
    try:
        return (fp, float(until)) if fp else None
    except ValueError:
        return None


def deleting(body: Mapping[str, Any]) -> bool:
    return bool(body.get("metadata", {}).get("deletionTimestamp"))


def choose_serving(live: list[Obj], endpoint: Obj | None, current: str) -> str:
    """The generation the endpoint Service selects: it moves to `current` once that one is Ready,
    or at once when the generation it selects has no workloads left to serve."""
    selected = ((endpoint or {}).get("spec") or {}).get("selector", {}).get(ap.LABEL_FINGERPRINT)
    if not selected or selected == current:
        return current
    if st.generation_ready(live, current) or not st.workloads(live, selected):
        return current
    return selected


def desired(body: Mapping[str, Any], children: list[Obj]) -> list[Obj]:
    """Rendered children, owned by the resource (kopf.adopt) and stamped with their content hash."""
    for child in children:
        kopf.adopt(child, owner=body)  # type: ignore[arg-type]
    return [ap.stamp(c) for c in children]


async def served_version(api: Api, api_version: str) -> str:
    fallback = ap.FALLBACK_VERSIONS.get(api_version)
    if fallback and not await api.serves(api_version) and await api.serves(fallback):
        return fallback
    return api_version


async def read_live(api: Api, namespace: str, name: str) -> tuple[list[Obj], list[Obj]]:
    labels = {ap.LABEL_DEPLOYMENT: name}
    kinds = [(await served_version(api, v), k) for v, k in ap.CHILD_KINDS]

    async def listed(api_version: str, kind: str) -> list[Obj]:
        try:
            return await api.list(api_version, kind, namespace, labels)
        except ApiError as e:
            if e.status == 403 and (api_version, kind) in ap.OPTIONAL_KINDS:
                return []
            raise

    lists = await asyncio.gather(
        *(listed(v, k) for v, k in kinds),
        api.list("v1", "Pod", namespace, labels),
    )
    children = [o for group in lists[:-1] for o in group]
    return children, lists[-1]


def _rejection(obj: Mapping[str, Any], e: ApiError) -> st.Problem:
    reason = "ApplyForbidden" if e.status == 403 else "ApplyRejected"
    return st.Problem(reason, f"{obj['kind']}/{obj['metadata']['name']}: {e.message}")


async def reconcile(
    api: Api,
    body: Mapping[str, Any],
    *,
    render: Callable[..., list[Obj]],
    parse: Callable[[Mapping[str, Any]], Any],
    fingerprint: Callable[[Any], str],
    event: EventFn,
    drain_seconds: float = 0.0,
) -> Outcome:
    out = Outcome()
    meta = body["metadata"]
    if deleting(body):  # owner references let the garbage collector remove the children
        return out
    ns, name, uid = meta.get("namespace", "default"), meta["name"], meta.get("uid")
    live, pods = await read_live(api, ns, name)

    try:
        dep = parse(copy.deepcopy(dict(body)))  # a plain dict: kopf's Body is a read-only view
    except ValueError as e:  # SpecError: the webhook was bypassed or is not installed
        out.error = st.Problem("InvalidSpec", str(e))
        await _write_status(api, body, out, live, pods, current="", serving="", endpoint=None)
        if out.status_written:  # once per change, not once per resync
            event("Warning", "InvalidSpec", str(e))
        return out

    current = fingerprint(dep)
    by_key = {ap.key(o): o for o in live}
    endpoint_live = by_key.get(("Service", name))
    serving = choose_serving(live, endpoint_live, current)
    previous = ((endpoint_live or {}).get("spec") or {}).get("selector", {}).get(ap.LABEL_FINGERPRINT)

    rendered = render(dep, serving_fingerprint=serving, namespace=ns)
    keep = {serving} if serving != current else set()
    drain = draining(endpoint_live, previous, serving, time.time(), drain_seconds)
    if drain is not None:
        for obj in rendered:
            if (obj["kind"], obj["metadata"]["name"]) == ("Service", name):
                obj["metadata"].setdefault("annotations", {})[DRAIN_ANNOTATION] = f"{drain[0]} {drain[1]:.0f}"
        if drain[0] != serving and time.time() < drain[1]:
            keep.add(drain[0])
            out.recheck_in = drain[1] - time.time()
    for obj in rendered:
        obj["apiVersion"] = await served_version(api, obj["apiVersion"])
    want = desired(body, rendered)
    if deleting(body):  # the resource may have been deleted while we read
        return out
    await _apply(api, want, by_key, out)
    await _prune(api, live, want, by_key, out, keep=keep, uid=uid)
    endpoint = by_key.get(("Service", name))
    await _write_status(api, body, out, list(by_key.values()), pods, current=current, serving=serving,
                        endpoint=endpoint)  # fmt: skip
    _announce(event, out, previous=previous, serving=serving)
    return out


async def _apply(api: Api, want: list[Obj], by_key: dict[ap.Key, Obj], out: Outcome) -> None:
    """Apply what differs from live, concurrently (the API server orders nothing between them). An
    optional kind the cluster does not serve (a PodMonitor without the Prometheus Operator) is not
    sent at all, so a resync writes nothing for it; Degraded names it until its CRD appears."""
    changes = []
    for obj in want:
        why = ap.why_apply(obj, by_key.get(ap.key(obj)))
        if why is None:
            continue
        if (obj["apiVersion"], obj["kind"]) in ap.OPTIONAL_KINDS and not await api.serves(obj["apiVersion"]):
            out.error = out.error or st.Problem(
                "KindNotServed",
                f"{obj['kind']}/{obj['metadata']['name']}: this cluster does not serve {obj['apiVersion']} "
                "(install the Prometheus Operator's CRDs, or turn spec.monitoring.podMonitor off)",
            )
            continue
        changes.append((obj, why))
    results = await asyncio.gather(*(api.apply(obj) for obj, _ in changes), return_exceptions=True)
    for (obj, why), result in zip(changes, results, strict=True):
        label = "/".join(ap.key(obj))
        if isinstance(result, ApiError) and (result.status >= 500 or result.status == 429):
            raise kopf.TemporaryError(f"applying {label}: {result}", delay=5) from result
        if isinstance(result, ApiError):  # refused (invalid, forbidden, an admission webhook): report
            out.error = out.error or _rejection(obj, result)
        elif isinstance(result, BaseException):
            raise result
        else:
            by_key[ap.key(obj)] = result
            out.applied.append(f"{label} ({why})")


async def _prune(
    api: Api, live: list[Obj], want: list[Obj], by_key: dict[ap.Key, Obj], out: Outcome, *,
    keep: set[str], uid: str | None,
) -> None:  # fmt: skip
    """Delete owned children that left the plan, except those of a generation that still serves."""
    for obj in ap.stale(live, want, keep=keep, uid=uid):
        await api.delete(obj)
        by_key.pop(ap.key(obj), None)
        out.deleted.append("/".join(ap.key(obj)))


async def _write_status(
    api: Api, body: Mapping[str, Any], out: Outcome, live: list[Obj], pods: list[Obj], *,
    current: str, serving: str, endpoint: Obj | None,
) -> None:  # fmt: skip
    old = body.get("status") or {}
    new = st.build(
        generation=body["metadata"].get("generation"), objs=live, pods=pods,
        current=current, serving=serving, service=endpoint, old=old, error=out.error,
    )  # fmt: skip
    meta = body["metadata"]
    have = st.roles(live, serving) if serving else {}
    metrics.record_resource(
        meta.get("namespace", "default"), meta["name"], new["conditions"],
        replicas=st.desired_replicas(live, serving) if serving else {},
        ready={r: v["readyReplicas"] for r, v in have.items()},
    )  # fmt: skip
    if st.differs(new, old):
        await api.patch_status(body, st.patch(new, old))
        out.status_written = True


def _announce(event: EventFn, out: Outcome, *, previous: str | None, serving: str) -> None:
    if out.applied:
        event("Normal", "Applied", f"applied {len(out.applied)}: {', '.join(out.applied)}")
    if out.deleted:
        event("Normal", "Deleted", f"deleted {len(out.deleted)}: {', '.join(out.deleted)}")
    if previous and previous != serving:
        event("Normal", "EndpointMoved", f"endpoint now serves generation {serving} (was {previous})")
    if out.error is not None and out.status_written:
        event("Warning", out.error.reason, out.error.message)
