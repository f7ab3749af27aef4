"""Keeping the CRD current on `helm upgrade`, which never touches what sits in a chart's `crds/`.

At start, before it watches anything, the operator compares the live Dsv4Deployment CRD with the one
it bundles (`crd.load_crd`) and applies its own, server-side under its field manager, when the live
one is older or differs. Every apply stamps `dsv4.ai/operator-version`; a live CRD stamped by a newer
operator is left alone, so an old pod still running mid-rollout never undoes a new schema. A CRD that
`helm install` created carries no stamp and is brought to the operator's (the same chart's) content.
Below Kubernetes 1.25 the CEL-free variant is applied (those servers cannot store CEL rules).

The chart's ClusterRole grants get and patch on this one CRD only (`resourceNames`); an older chart
without that rule gets a 403, logged, and the operator goes on with the CRD it finds.
"""

from __future__ import annotations

import copy
import logging
import re
from importlib import metadata
from typing import Any

from . import apply as ap
from .crd import load_crd
from .kube import Api, ApiError

CRD_API = "apiextensions.k8s.io/v1"
CRD_NAME = "dsv4deployments.dsv4.ai"
VERSION_ANNOTATION = "dsv4.ai/operator-version"
CEL_SINCE = (1, 25)

log = logging.getLogger(__name__)


def operator_version() -> str:
    try:
        return metadata.version("dsv4")
    except metadata.PackageNotFoundError:
        return "0"


def version_key(version: str) -> tuple[int, ...]:
    """Release numbers of a version string, for ordering (`0.2.0rc1` -> (0, 2, 0))."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0].split("rc")[0])[:3])


def desired_crd(version: str, server: tuple[int, int]) -> dict[str, Any]:
    """The bundled CRD as this operator applies it to a server of `server` (major, minor)."""
    crd = load_crd(cel=server >= CEL_SINCE)
    crd.setdefault("metadata", {}).setdefault("annotations", {})[VERSION_ANNOTATION] = version
    return crd


def decide(live: dict[str, Any] | None, want: dict[str, Any]) -> str:
    """What to do with the live CRD: `apply`, or leave it (`current`, `newer`)."""
    if live is None:
        return "apply"
    theirs = ((live.get("metadata") or {}).get("annotations") or {}).get(VERSION_ANNOTATION)
    ours = want["metadata"]["annotations"][VERSION_ANNOTATION]
    if theirs is not None and version_key(theirs) > version_key(ours):
        return "newer"
    if theirs == ours and ap.covers(live.get("spec"), want["spec"]):
        return "current"
    return "apply"


async def server_version(api: Api) -> tuple[int, int]:
    got = await api._call("GET", "/version")
    return int(got["major"]), int(re.sub(r"\D.*", "", got["minor"]) or 0)


async def ensure_current(api: Api, version: str | None = None) -> str:
    """Bring the live CRD to the bundled one unless it is newer; returns what happened: `applied`,
    `current`, `newer` or `forbidden`."""
    version = version or operator_version()
    want = desired_crd(version, await server_version(api))
    try:
        live = await api.get(CRD_API, "CustomResourceDefinition", None, CRD_NAME)
        action = decide(live, want)
        if action == "newer":
            theirs = live["metadata"]["annotations"][VERSION_ANNOTATION]  # type: ignore[index]
            log.info("CRD %s is from operator %s, newer than %s: left as it is", CRD_NAME, theirs, version)
            return action
        if action == "current":
            return action
        await api.apply(copy.deepcopy(want))
    except ApiError as e:
        if e.status != 403:
            raise
        log.warning("cannot keep CRD %s current (%s): the chart's RBAC predates it; going on", CRD_NAME, e)
        return "forbidden"
    log.info("CRD %s applied (operator %s)", CRD_NAME, version)
    return "applied"
