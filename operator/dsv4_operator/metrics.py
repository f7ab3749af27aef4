"""The operator's own Prometheus metrics: reconciles (count, duration, errors) and API writes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

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
