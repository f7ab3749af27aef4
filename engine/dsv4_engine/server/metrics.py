"""Prometheus metrics: latency histograms kept by the server, engine gauges read at scrape time.

The engine's own numbers come from `engine.metrics()` (a dict of counters and gauges, copied by the
engine thread after every step), so a scrape never touches the engine and never waits for a step.

Beside the `dsv4_*` series, `_VllmCollector` exports the same data under the `vllm:*` names that
vLLM's Grafana dashboards, the Gateway API Inference Extension's endpoint picker and KEDA recipes
read, each with `model_name` and `role` labels: one source, two names, so the two can never disagree.
docs/observability.md lists every series.
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
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "dsv4"
# Why a request is refused before the engine: the server's phase when not ready (state.Phase), or a
# full queue.
REJECTION_REASONS = ("loading", "draining", "stopped", "dead", "queue_full")
# Why a PD request fails, as disagg/ raises them (tests/monitoring checks that list against the code);
# a reason a peer reports is counted under its own name too.
PD_FAILURE_REASONS = (
    "bad_aux", "bootstrap_timeout", "bootstrap_unreachable", "client_gone", "decode_gone",
    "layout_mismatch", "payload_mismatch", "peer_dead", "prefill_dead", "prompt_mismatch", "quarantined",
    "queue_full", "room_in_use", "transfer_failed", "transfer_timeout", "unknown_room", "unknown_session",
)  # fmt: skip

# How the prefill writes a request's pages (disagg/transfer.py: PATHS, path_label), each counter
# present from the start at 0 (tests/monitoring checks the list against the code).
PD_WRITE_PATHS = (
    "direct", "staged", "staged_pipelined", "pack_only", "pack_only_pipelined", "unpack_only",
)  # fmt: skip

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
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens of admitted requests since start.", True),
    "prefix_cache_hits": (
        "prefix_cache_hits",
        "Of the prompt tokens of admitted requests, those resumed from the prefix cache.",
        True,
    ),
    "prefix_cache_nodes": ("prefix_cache_nodes", "Nodes of the prefix cache's radix tree.", False),
    "prefix_cache_snapshots": (
        "prefix_cache_snapshots",
        "Prefixes the prefix cache can resume a request from (state snapshots it keeps).",
        False,
    ),
    "spec_decode_num_drafts": (
        "spec_decode_num_drafts",
        "Speculative decoding: a request's verify steps that carried draft tokens, since start.",
        True,
    ),
    "spec_decode_num_draft_tokens": (
        "spec_decode_num_draft_tokens",
        "Speculative decoding: draft tokens proposed by the MTP layer since start.",
        True,
    ),
    "spec_decode_num_accepted_tokens": (
        "spec_decode_num_accepted_tokens",
        "Speculative decoding: draft tokens the target model kept since start.",
        True,
    ),
}
# engine.metrics() per-pool key prefix -> (metric name, help)
_POOL_KEYS = {
    "pool_usage/": ("pool_usage_ratio", "Fraction of each memory pool in use."),
    "pool_free/": ("pool_free_pages", "Free pages in each memory pool."),
    "pool_available/": (
        "pool_available_pages",
        "Pages requests can take in each memory pool: free, or held by the prefix cache alone.",
    ),
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
        hit_rate = prefix_cache_hit_rate(snap)
        acceptance, mean_length = spec_decode_acceptance_rate(snap), spec_decode_mean_acceptance_length(snap)
        for key, (name, help_text, is_counter) in _ENGINE_KEYS.items():
            value = float(snap.pop(key, 0.0))
            if is_counter:
                yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
            else:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
        yield GaugeMetricFamily(
            f"{PREFIX}_prefix_cache_hit_rate",
            "Share of admitted prompt tokens resumed from the prefix cache since start (0 before any).",
            value=hit_rate,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_spec_decode_acceptance_rate",
            "Speculative decoding: accepted / proposed draft tokens since start (0 before any).",
            value=acceptance,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_spec_decode_mean_acceptance_length",
            "Speculative decoding: tokens a request gains per verify step, 1 + accepted / drafts, since "
            "start (0 before any).",
            value=mean_length,
        )
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


def kv_cache_usage(snapshot: Mapping[str, float]) -> float:
    """The one KV usage figure: the fullest page family's share in use. A request needs pages of every
    family (SWA, full, compressor state), so the fullest one is what refuses the next request."""
    usage = [float(v) for k, v in snapshot.items() if k.startswith("pool_usage/")]
    return max(usage, default=0.0)


def prefix_cache_hit_rate(snapshot: Mapping[str, float]) -> float:
    """prefix_cache_hits / prefix_cache_queries, 0 when no prompt was admitted yet."""
    queries = float(snapshot.get("prefix_cache_queries", 0.0))
    return float(snapshot.get("prefix_cache_hits", 0.0)) / queries if queries else 0.0


def spec_decode_acceptance_rate(snapshot: Mapping[str, float]) -> float:
    """spec_decode_num_accepted_tokens / spec_decode_num_draft_tokens, 0 when nothing was drafted."""
    drafted = float(snapshot.get("spec_decode_num_draft_tokens", 0.0))
    return float(snapshot.get("spec_decode_num_accepted_tokens", 0.0)) / drafted if drafted else 0.0


def spec_decode_mean_acceptance_length(snapshot: Mapping[str, float]) -> float:
    """Tokens per verify step, 1 + accepted / drafts (the target's own token plus the kept drafts,
    vLLM's "mean acceptance length"), 0 when no step carried drafts."""
    drafts = float(snapshot.get("spec_decode_num_drafts", 0.0))
    return 1.0 + float(snapshot.get("spec_decode_num_accepted_tokens", 0.0)) / drafts if drafts else 0.0


_VLLM_LABELS = {"finish_reason": "finished_reason"}  # vLLM's spelling of the same label


class _VllmCollector(Collector):
    """The `vllm:*` names (vLLM 0.11's) over this server's own histograms, counters and engine
    snapshot, labelled with the served model and the PD role.

    Under PD a prompt is counted on both servers (the decode admits it with its transferred state)
    and so is the first token: sum prompt tokens over role != "decode" and generated tokens over
    role != "prefill" for a deployment's totals."""

    def __init__(self, metrics: ServerMetrics, snapshot: Callable[[], Mapping[str, float]]) -> None:
        self._m = metrics
        self._snapshot = snapshot

    def _labels(self) -> dict[str, str]:
        return {"model_name": self._m.model_name, "role": self._m.role}

    def _renamed(self, source: Histogram | Counter, name: str, kind: str, doc: str) -> Iterator[Metric]:
        for family in source.collect():
            out = Metric(name, doc, kind)
            for sample in family.samples:
                suffix = sample.name[len(family.name) :]  # _bucket / _sum / _count / _total
                labels = {_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}
                out.add_sample(name + suffix, {**labels, **self._labels()}, sample.value)
            yield out

    def collect(self) -> Iterator[Metric]:
        m, labels = self._m, self._labels()
        yield from self._renamed(m.ttft, "vllm:time_to_first_token_seconds", "histogram",
                                 "Time from request arrival to its first generated token.")  # fmt: skip
        for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
            yield from self._renamed(
                m.itl, name, "histogram", "Time between consecutive tokens of a request."
            )
        yield from self._renamed(m.e2e, "vllm:e2e_request_latency_seconds", "histogram",
                                 "Time from request arrival to its last token.")  # fmt: skip
        yield from self._renamed(m.finished, "vllm:request_success", "counter",
                                 "Requests finished, by finished_reason.")  # fmt: skip
        snap = dict(self._snapshot())
        keys, values = list(labels), list(labels.values())
        for key, name, doc, counter in (
            ("num_running", "vllm:num_requests_running", "Requests in the running batch.", False),
            ("num_waiting", "vllm:num_requests_waiting", "Requests waiting to be scheduled.", False),
            ("prompt_tokens_total", "vllm:prompt_tokens", "Prompt tokens admitted since start.", True),
            ("generation_tokens_total", "vllm:generation_tokens", "Tokens generated since start.", True),
            ("num_preemptions", "vllm:num_preemptions", "Requests preempted since start.", True),
            ("prefix_cache_queries", "vllm:prefix_cache_queries",
             "Prompt tokens of admitted requests since start.", True),
            ("prefix_cache_hits", "vllm:prefix_cache_hits",
             "Prompt tokens resumed from the prefix cache since start.", True),
            ("spec_decode_num_drafts", "vllm:spec_decode_num_drafts",
             "Speculative decoding: verify steps (per request) that carried drafts since start.", True),
            ("spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens",
             "Speculative decoding: draft tokens proposed since start.", True),
            ("spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
             "Speculative decoding: draft tokens accepted since start.", True),
        ):  # fmt: skip
            family = CounterMetricFamily if counter else GaugeMetricFamily
            metric = family(name, doc, labels=keys)
            metric.add_metric(values, float(snap.get(key, 0.0)))
            yield metric
        usage = kv_cache_usage(snap)
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):  # the older name too
            metric = GaugeMetricFamily(name, "KV pools in use, 0 to 1: the fullest page family.", labels=keys)
            metric.add_metric(values, usage)
            yield metric


class ServerMetrics:
    def __init__(
        self,
        engine_snapshot: Callable[[], Mapping[str, float]],
        *,
        model_name: str = "",
        role: str = "colocated",
    ) -> None:
        """model_name, role: the `vllm:*` series' labels (the served model; prefill, decode or
        colocated)."""
        self.model_name, self.role = model_name, role
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
        for reason in REJECTION_REASONS:  # at 0 from the start: a rate over them is 0, not "no data"
            self.rejected.labels(reason)
        # PD (disagg/): what moved, how long it took, and why it failed.
        self.pd_bytes = Counter(
            f"{PREFIX}_pd_transfer_bytes",
            "Bytes of paged state moved, by state type: sent to decode servers (prefill), received "
            "from prefill servers (decode).",
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
            "per layer buffer), staged (packed here, one entry, unpacked by the decode), pack_only "
            "(packed here, an entry per run of the decode's pages), unpack_only (an entry per run of "
            "ours into the decode's span, unpacked there); _pipelined: packed in pieces, each while "
            "the one before is on the wire.",
            ["path"],
            registry=r,
        )
        for path in PD_WRITE_PATHS:
            self.pd_writes.labels(path)
        self.pd_rank_bytes = Counter(
            f"{PREFIX}_pd_rank_bytes",
            "Bytes of paged state each rank of this prefill server wrote to each rank of a decode "
            "server (decode rank r takes its copy from prefill rank r mod the prefill's size).",
            ["rank", "peer_rank"],
            registry=r,
        )
        self.pd_failures = Counter(
            f"{PREFIX}_pd_failures", "PD requests that failed, by reason.", ["reason"], registry=r
        )
        for reason in PD_FAILURE_REASONS:
            self.pd_failures.labels(reason)
        self.pd_queue = Gauge(f"{PREFIX}_pd_queue_depth", "PD requests in each queue.", ["queue"], registry=r)
        self.ready = Gauge(f"{PREFIX}_server_ready", "1 when /health answers 200.", registry=r)
        self.prewarm = Gauge(
            f"{PREFIX}_process_group_prewarm_seconds",
            "Seconds a parallel server's process groups took to prewarm before it reported ready "
            "(one small collective per group); 0 on one rank.",
            registry=r,
        )
        self.inflight = Gauge(
            f"{PREFIX}_requests_in_flight", "Requests admitted and not yet finished.", registry=r
        )
        self.prefix_imported = Gauge(
            f"{PREFIX}_prefix_cache_imported_prefixes",
            "Prefixes imported from --prefix-cache-dir at start (0: none, or the file was refused: "
            "its log line says why).",
            registry=r,
        )
        self.prefix_saved = Gauge(
            f"{PREFIX}_prefix_cache_saved_prefixes",
            "Prefixes the last save to --prefix-cache-dir wrote (0: none saved yet).",
            registry=r,
        )
        self.prefix_saved_at = Gauge(
            f"{PREFIX}_prefix_cache_last_save_timestamp_seconds",
            "Unix time of the last save to --prefix-cache-dir (0: none yet); a save is skipped while "
            "the cache is unchanged, so alert on its age only beside traffic.",
            registry=r,
        )
        self.peer_fetches = Counter(
            f"{PREFIX}_prefix_cache_peer_fetches",
            "Prompts that lacked more than a page of their prefix here, by what --prefix-cache-peers "
            "gave: fetched (a peer's cache resumed further), none (no peer's did), failed (a peer "
            "failed, differed in layout, or did not answer in time).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("fetched", "none", "failed"):
            self.peer_fetches.labels(outcome)
        self.peer_tokens = Counter(
            f"{PREFIX}_prefix_cache_peer_fetched_tokens",
            "Prompt tokens whose state was fetched from --prefix-cache-peers instead of prefilled.",
            registry=r,
        )
        self.peer_exports = Counter(
            f"{PREFIX}_prefix_cache_peer_exports",
            "Prefixes this server's cache gave to peers (POST /prefix_cache/fetch).",
            registry=r,
        )
        r.register(_EngineCollector(engine_snapshot))
        r.register(_VllmCollector(self, engine_snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
