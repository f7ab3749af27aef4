"""Prometheus metrics: latency histograms kept by the server, engine gauges read at scrape time.

The engine's own numbers come from `engine.metrics()` (a dict of counters and gauges, copied by the
engine thread after every step), so a scrape never touches the engine and never waits for a step.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "dsv4"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)

# engine.metrics() key -> (metric name, help, is_counter)
_ENGINE_KEYS = {
    "num_running": ("num_requests_running", "Requests in the running batch.", False),
    "num_waiting": ("num_requests_waiting", "Requests waiting to be scheduled.", False),
    "num_preemptions": ("preemptions", "Requests preempted (recomputed later) since start.", True),
    "prompt_tokens_total": ("prompt_tokens", "Prompt tokens prefilled since start.", True),
    "generation_tokens_total": ("generation_tokens", "Tokens generated since start.", True),
    "num_aborted": ("aborted_requests", "Requests aborted in the engine since start.", True),
}
# engine.metrics() per-pool key prefix -> (metric name, help)
_POOL_KEYS = {
    "pool_usage/": ("pool_usage_ratio", "Fraction of each memory pool in use."),
    "pool_free/": ("pool_free_pages", "Free pages in each memory pool."),
    "pool_total/": ("pool_total_pages", "Pages in each memory pool."),
}


def _metric_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_").lower()


class _EngineCollector(Collector):
    """Exports the latest engine.metrics() snapshot; unknown keys become dsv4_engine_<key> gauges."""

    def __init__(self, snapshot: Callable[[], Mapping[str, float]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = dict(self._snapshot())
        for key, (name, help_text, is_counter) in _ENGINE_KEYS.items():
            value = float(snap.pop(key, 0.0))
            if is_counter:
                yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
            else:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
        for prefix, (name, help_text) in _POOL_KEYS.items():
            family = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=["pool"])
            for key in sorted(k for k in snap if k.startswith(prefix)):
                family.add_metric([key[len(prefix) :]], float(snap.pop(key)))
            yield family
        for key in sorted(snap):
            value = snap[key]
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(
                    f"{PREFIX}_engine_{_metric_name(key)}", f"engine.metrics()['{key}']", value=value
                )


class ServerMetrics:
    def __init__(self, engine_snapshot: Callable[[], Mapping[str, float]]) -> None:
        disable_created_metrics()  # `_created` series double the output and nobody graphs them
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.step = Histogram(
            f"{PREFIX}_engine_step_seconds",
            "Duration of one engine step (a prefill chunk and/or one decode token for the batch).",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.finished = Counter(
            f"{PREFIX}_requests_finished",
            "Generation requests finished, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            f"{PREFIX}_requests_rejected",
            "Requests refused before reaching the engine, by reason.",
            ["reason"],
            registry=r,
        )
        # PD (disagg/): what moved, how long it took, and why it failed.
        self.pd_bytes = Counter(
            f"{PREFIX}_pd_transfer_bytes",
            "Bytes of paged state moved to decode servers, by state type (prefill side).",
            ["state_type"],
            registry=r,
        )
        self.pd_transfer_seconds = Histogram(
            f"{PREFIX}_pd_transfer_seconds",
            "Per request: from the decode's pages being known (prefill) or reserved (decode) to the "
            "transfer's end.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.pd_handshake_seconds = Histogram(
            f"{PREFIX}_pd_handshake_seconds",
            "Pairing with a prefill server: route, fingerprint check, session registration (decode side).",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.pd_writes = Counter(
            f"{PREFIX}_pd_transfer_writes",
            "Mooncake writes to decode servers (prefill side), by path: direct (an entry per page run "
            "per layer buffer) or staged (the pages packed into one entry, unpacked by the decode).",
            ["path"],
            registry=r,
        )
        self.pd_failures = Counter(
            f"{PREFIX}_pd_failures", "PD requests that failed, by reason.", ["reason"], registry=r
        )
        self.pd_queue = Gauge(f"{PREFIX}_pd_queue_depth", "PD requests in each queue.", ["queue"], registry=r)
        self.ready = Gauge(f"{PREFIX}_server_ready", "1 when /health answers 200.", registry=r)
        self.inflight = Gauge(
            f"{PREFIX}_requests_in_flight", "Requests admitted and not yet finished.", registry=r
        )
        r.register(_EngineCollector(engine_snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
