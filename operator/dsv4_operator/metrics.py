"""The operator's own Prometheus metrics: reconciles (count, duration, errors), API writes, and per
Dsv4Deployment its conditions and each role's desired and ready replicas (of the serving generation),
which the alert rules read (charts/dsv4-operator/files/alerts.yaml)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry()
RECONCILES = Counter(
    "dsv4_operator_reconcile_total", "Reconciles of Dsv4Deployments by result.", ["result"], registry=REGISTRY
)
DURATION = Histogram(
    "dsv4_operator_reconcile_duration_seconds", "Time one reconcile takes.", registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)  # fmt: skip
ERRORS = Counter(
    "dsv4_operator_reconcile_errors_total",
    "Reconciles that failed, by reason.",
    ["reason"],
    registry=REGISTRY,
)
WRITES = Counter(
    "dsv4_operator_api_writes_total",
    "Write requests sent to the API server.",
    ["verb", "kind"],
    registry=REGISTRY,
)


CONDITION = Gauge(
    "dsv4_operator_resource_condition",
    "1 while a condition (Ready, Progressing, Degraded) of a Dsv4Deployment is True, else 0.",
    ["dsv4_namespace", "dsv4_deployment", "type"],
    registry=REGISTRY,
)
ROLE_REPLICAS = Gauge(
    "dsv4_operator_role_replicas",
    "Desired replicas of each role of a Dsv4Deployment's serving generation.",
    ["dsv4_namespace", "dsv4_deployment", "role"],
    registry=REGISTRY,
)
ROLE_READY = Gauge(
    "dsv4_operator_role_ready_replicas",
    "Ready replicas of each role of a Dsv4Deployment's serving generation.",
    ["dsv4_namespace", "dsv4_deployment", "role"],
    registry=REGISTRY,
)
# Not `namespace`: a scrape's own target label of that name would rename it (exported_namespace).
# dsv4_deployment is also what the PodMonitor labels the servers' series with.
_RECORDED: dict[tuple[str, str], tuple[set[str], set[str]]] = {}  # (ns, name) -> (types, roles)


def record_resource(
    namespace: str,
    name: str,
    conditions: Iterable[Mapping[str, Any]],
    replicas: Mapping[str, int],
    ready: Mapping[str, int],
) -> None:
    """The resource's conditions and its serving generation's roles, as last reconciled; series of
    roles that left are removed."""
    types, roles = _RECORDED.setdefault((namespace, name), (set(), set()))
    for c in conditions:
        CONDITION.labels(namespace, name, c["type"]).set(1 if c["status"] == "True" else 0)
        types.add(c["type"])
    for role in roles - set(replicas):
        ROLE_REPLICAS.remove(namespace, name, role)
        ROLE_READY.remove(namespace, name, role)
    roles.clear()
    for role, n in replicas.items():
        ROLE_REPLICAS.labels(namespace, name, role).set(n)
        ROLE_READY.labels(namespace, name, role).set(ready.get(role, 0))
        roles.add(role)


def forget_resource(namespace: str, name: str) -> None:
    """Remove a resource's series (deleted, or this replica stopped leading)."""
    types, roles = _RECORDED.pop((namespace, name), (set(), set()))
    for t in types:
        CONDITION.remove(namespace, name, t)
    for role in roles:
        ROLE_REPLICAS.remove(namespace, name, role)
        ROLE_READY.remove(namespace, name, role)


def count_write(verb: str, kind: str) -> None:
    WRITES.labels(verb=verb, kind=kind).inc()


@contextlib.contextmanager
def timed_reconcile() -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    except Exception as e:
        RECONCILES.labels(result="error").inc()
        ERRORS.labels(reason=type(e).__name__).inc()
        raise
    else:
        RECONCILES.labels(result="ok").inc()
    finally:
        DURATION.observe(time.perf_counter() - start)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """/metrics on its own port (a daemon thread), apart from kopf's liveness endpoint."""
    start_http_server(port, addr=addr, registry=REGISTRY)
