"""Status from what is live: per-role counts, generation readiness, and conditions whose reasons come
from what is really wrong (a pod that cannot be scheduled, a crash loop, an image that cannot be
pulled, an apply the API server rejected). Pure functions of plain dicts."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .apply import LABEL_FINGERPRINT, LABEL_ROLE, fingerprint_of

WORKLOAD_KINDS = ("StatefulSet", "Deployment")
# Container waiting reasons that will not fix themselves; the first found names the Degraded reason.
BAD_WAITING = (
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
)

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


def workloads(objs: Iterable[Obj], fingerprint: str) -> list[Obj]:
    return [o for o in objs if o.get("kind") in WORKLOAD_KINDS and fingerprint_of(o) == fingerprint]


def ready(obj: Obj) -> bool:
    want = (obj.get("spec") or {}).get("replicas", 1)
    got = (obj.get("status") or {}).get("readyReplicas") or 0
    return got >= want


def generation_ready(objs: Iterable[Obj], fingerprint: str) -> bool:
    """Every workload of the generation has all its replicas ready (and there is at least one)."""
    mine = workloads(objs, fingerprint)
    return bool(mine) and all(ready(o) for o in mine)


def roles(objs: Iterable[Obj], fingerprint: str) -> dict[str, dict[str, Any]]:
    """Per role of one generation: replicas, readyReplicas, updatedReplicas and the pods' selector."""
    out: dict[str, dict[str, Any]] = {}
    for o in workloads(objs, fingerprint):
        role = (o["metadata"].get("labels") or {}).get(LABEL_ROLE, o["metadata"]["name"])
        st = o.get("status") or {}
        match = ((o.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        out[role] = {
            "replicas": int(st.get("replicas") or 0),
            "readyReplicas": int(st.get("readyReplicas") or 0),
            "updatedReplicas": int(st.get("updatedReplicas") or 0),
            "selector": ",".join(f"{k}={v}" for k, v in sorted(match.items())),
        }
    return out


def desired_replicas(objs: Iterable[Obj], fingerprint: str) -> dict[str, int]:
    return {
        (o["metadata"].get("labels") or {}).get(LABEL_ROLE, o["metadata"]["name"]): int(
            (o.get("spec") or {}).get("replicas", 1)
        )
        for o in workloads(objs, fingerprint)
    }


def pod_problems(pods: Iterable[Obj], fingerprint: str | None = None) -> list[Problem]:
    """What keeps pods (of one generation, or all) from running, most blocking first."""
    unschedulable: list[Problem] = []
    broken: list[Problem] = []
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels") or {}
        if fingerprint is not None and labels.get(LABEL_FINGERPRINT) != fingerprint:
            continue
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        for cond in status.get("conditions") or []:
            if (cond.get("type"), cond.get("status"), cond.get("reason")) == (
                "PodScheduled",
                "False",
                "Unschedulable",
            ):
                unschedulable.append(Problem("Unschedulable", f"pod {name}: {cond.get('message', '')}"))
        for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in BAD_WAITING:
                msg = f"pod {name} container {cs.get('name')}: {waiting['reason']}"
                if waiting.get("message"):
                    msg += f": {waiting['message']}"
                broken.append(Problem(waiting["reason"], msg))
    return broken + unschedulable


def _summary(problems: list[Problem]) -> Problem:
    first = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return Problem(first.reason, first.message + more)


def _cond(type_: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def conditions(
    objs: list[Obj],
    pods: list[Obj],
    *,
    current: str,
    serving: str,
    error: Problem | None = None,
) -> list[dict[str, str]]:
    """Ready, Progressing, Degraded (without timestamps: `merge_conditions` keeps those stable)."""
    serving_ok = generation_ready(objs, serving)
    current_ok = generation_ready(objs, current)
    rolling = serving != current
    new_problems = pod_problems(pods, current)
    all_problems = pod_problems(pods)

    if serving_ok:
        ready_c = _cond("Ready", True, "AllRolesReady", f"generation {serving} serves the endpoint")
    else:
        have = roles(objs, serving)
        waiting = [
            f"{r} {have[r]['readyReplicas']}/{n}" for r, n in sorted(desired_replicas(objs, serving).items())
            if have[r]["readyReplicas"] < n
        ]  # fmt: skip
        p = _summary(all_problems) if all_problems else None
        ready_c = _cond(
            "Ready", False, p.reason if p else "RolesNotReady",
            p.message if p else "waiting for ready replicas: " + (", ".join(waiting) or "no workloads yet"),
        )  # fmt: skip

    if current_ok and not rolling:
        prog = _cond("Progressing", False, "Complete", f"generation {current} is ready and serving")
    elif new_problems and new_problems[0].reason == "Unschedulable":
        p = _summary([q for q in new_problems if q.reason == "Unschedulable"])
        keep = f"; generation {serving} keeps serving" if rolling else ""
        prog = _cond("Progressing", True, "InsufficientCapacity", p.message + keep)
    elif rolling:
        prog = _cond("Progressing", True, "NewGeneration", f"rolling out {current} beside {serving}")
    else:
        prog = _cond("Progressing", True, "WaitingForReplicas", f"generation {current} is starting")

    degrading = [q for q in all_problems if q.reason != "Unschedulable"]
    if error is not None:
        deg = _cond("Degraded", True, error.reason, error.message)
    elif degrading:
        p = _summary(degrading)
        deg = _cond("Degraded", True, p.reason, p.message)
    else:
        deg = _cond("Degraded", False, "AsExpected", "no failing pods")
    return [ready_c, prog, deg]


def merge_conditions(new: list[dict[str, str]], old: list[Mapping[str, Any]] | None, now: str) -> list[dict]:
    """Carry lastTransitionTime over while a condition's status holds, so an unchanged status is equal."""
    before = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        prev = before.get(c["type"])
        same = prev is not None and prev.get("status") == c["status"]
        out.append({**c, "lastTransitionTime": prev.get("lastTransitionTime", now) if same else now})
    return out


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def endpoint(service: Obj | None) -> str | None:
    if not service:
        return None
    meta = service["metadata"]
    ports = (service.get("spec") or {}).get("ports") or []
    port = f":{ports[0]['port']}" if ports else ""
    return f"http://{meta['name']}.{meta.get('namespace', 'default')}.svc{port}"


def build(
    *,
    generation: int | None,
    objs: list[Obj],
    pods: list[Obj],
    current: str,
    serving: str,
    service: Obj | None,
    old: Mapping[str, Any] | None,
    error: Problem | None = None,
    now: str | None = None,
) -> dict[str, Any]:
    old = old or {}
    conds = conditions(objs, pods, current=current, serving=serving, error=error)
    for c in conds:
        c["observedGeneration"] = generation  # type: ignore[assignment]
    return {
        "observedGeneration": generation,
        "fingerprint": current,
        "servingFingerprint": serving,
        "endpoint": endpoint(service),
        **roles(objs, current),
        "conditions": merge_conditions(conds, old.get("conditions"), now or now_iso()),
    }


ROLE_KEYS = ("prefill", "decode", "router")


def differs(new: Mapping[str, Any], old: Mapping[str, Any] | None) -> bool:
    old = old or {}
    gone = any(k in old and old[k] is not None and k not in new for k in ROLE_KEYS)
    return gone or any(old.get(k) != v for k, v in new.items())


def patch(new: Mapping[str, Any], old: Mapping[str, Any] | None) -> dict[str, Any]:
    """A merge patch from old to new: roles that disappeared are removed explicitly."""
    old = old or {}
    return {**new, **{k: None for k in ROLE_KEYS if k in old and k not in new}}
