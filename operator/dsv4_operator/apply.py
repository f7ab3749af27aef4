"""Desired-versus-live comparison for server-side apply: decide what to write, and what to delete.

Two checks keep a no-op resync free of writes while still restoring hand edits:
- the hash of the desired object, kept in the annotation `dsv4.ai/applied-hash`, changes whenever the
  operator's own rendering changes, including removed fields (which a subset check cannot see);
- `covers(live, desired)` finds fields that someone else changed after our last apply.
Only when either check fails is the object applied; the server then owns the merge.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from kubernetes.utils import parse_quantity

HASH_ANNOTATION = "dsv4.ai/applied-hash"
LABEL_DEPLOYMENT = "dsv4.ai/deployment"
LABEL_FINGERPRINT = "dsv4.ai/fingerprint"
LABEL_ROLE = "dsv4.ai/role"

# Every kind the operator may own; listed on each reconcile to find children that left the plan.
CHILD_KINDS: tuple[tuple[str, str], ...] = (
    ("apps/v1", "StatefulSet"),
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("policy/v1", "PodDisruptionBudget"),
    # Only when spec.monitoring.podMonitor asks; where its CRD is absent, listing it finds nothing (404).
    ("monitoring.coreos.com/v1", "PodMonitor"),
)
# Listed only where this operator may: an older chart's RBAC lacks them (403), which is no reason to
# stop reconciling what it can (asking for a PodMonitor there reports the apply's 403 as Degraded).
OPTIONAL_KINDS = frozenset({("monitoring.coreos.com/v1", "PodMonitor")})
# Older servers lack a version the renderer uses; the fields the operator sets are the same there.
FALLBACK_VERSIONS = {"policy/v1": "policy/v1beta1"}

Key = tuple[str, str]  # (kind, name): children live in their owner's namespace


def key(obj: Mapping[str, Any]) -> Key:
    return obj["kind"], obj["metadata"]["name"]


def content_hash(obj: Mapping[str, Any]) -> str:
    body = json.loads(json.dumps(obj, sort_keys=True))
    meta = body.get("metadata", {})
    meta.get("annotations", {}).pop(HASH_ANNOTATION, None)
    if "annotations" in meta and not meta["annotations"]:
        del meta["annotations"]
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with its content hash annotated (the annotation is part of what is applied)."""
    digest = content_hash(obj)
    obj.setdefault("metadata", {}).setdefault("annotations", {})[HASH_ANNOTATION] = digest
    return obj


def _zero(value: Any) -> bool:
    # The API server omits empty and zero values (omitempty), so a desired zero equals an absent field.
    return value in (None, False, 0, "", {}, [])


def _same_scalar(live: Any, want: Any) -> bool:
    if live == want:
        return True
    if isinstance(live, bool) or isinstance(want, bool):
        return False
    try:  # "1000m" comes back as "1", 8000 may come back as "8000"
        return parse_quantity(live) == parse_quantity(want)
    except (ValueError, TypeError):
        return str(live) == str(want)


def covers(live: Any, want: Any) -> bool:
    """True when every field of `want` has the same value in `live` (server defaults ignored)."""
    if isinstance(want, Mapping):
        if not isinstance(live, Mapping):
            return False
        return all(covers(live[k], v) if k in live else _zero(v) for k, v in want.items())
    if isinstance(want, list):
        if not isinstance(live, list) or len(live) != len(want):
            return False
        return all(covers(lv, wv) for lv, wv in zip(live, want, strict=True))
    return _same_scalar(live, want)


def why_apply(want: Mapping[str, Any], live: Mapping[str, Any] | None) -> str | None:
    """None when live already is what we want; else why not: absent, changed (by us), drifted."""
    if live is None:
        return "absent"
    if (live.get("metadata", {}).get("annotations") or {}).get(HASH_ANNOTATION) != content_hash(want):
        return "changed"
    return None if covers(live, want) else "drifted"


def needs_apply(want: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    return why_apply(want, live) is not None


def fingerprint_of(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata", {}).get("labels") or {}).get(LABEL_FINGERPRINT)


def owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return uid is None or any(r.get("uid") == uid for r in refs)


def stale(
    live: Iterable[Mapping[str, Any]],
    desired: Iterable[Mapping[str, Any]],
    *,
    keep: set[str],
    uid: str | None,
) -> list[Mapping[str, Any]]:
    """Live children of this owner that are not in the plan and not of a generation still kept."""
    wanted = {key(d) for d in desired}
    return [
        obj
        for obj in live
        if key(obj) not in wanted and owned_by(obj, uid) and fingerprint_of(obj) not in keep
        if not obj.get("metadata", {}).get("deletionTimestamp")
    ]
