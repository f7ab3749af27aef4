"""The Grafana dashboard (charts/dsv4-operator/files/dashboard.json): it parses, every panel's PromQL
names only series that exist (docs/observability.md's tables: the servers' and the operator's), and it
shows what the issue asks for, per deployment and per role."""

from __future__ import annotations

import json
import re
from typing import Any

from dsv4_operator import metrics

from .conftest import DASHBOARD, ROOT
from .series import DOC, known_series, series_in


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels() for t in p["targets"]]


def test_dashboard_is_grafana_json_with_its_variables() -> None:
    d = dashboard()
    assert d["uid"] == "dsv4-deployments" and d["schemaVersion"] >= 36
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "namespace", "deployment"}
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels():
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["refId"] and t["legendFormat"] for t in p["targets"]), p["title"]


def test_every_query_names_only_series_that_exist() -> None:
    known = known_series()
    for title, expr in queries():
        used = series_in(expr)
        assert used, (title, expr)
        assert used <= known, (title, used - known)
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            assert series_in(var["definition"].removeprefix("label_values(").rsplit(",", 1)[0]) <= known


def test_the_panels_cover_what_the_issue_asks_for() -> None:
    used = set().union(*(series_in(e) for _, e in queries()))
    asked = {
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",  # TTFT, ITL
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",  # tokens/s
        "vllm:num_requests_running", "vllm:num_requests_waiting",
        "dsv4_pool_usage_ratio",  # KV pool usage per state type
        "dsv4_pd_transfer_bytes_total", "dsv4_pd_failures_total",  # PD bandwidth and failures
        "vllm:num_preemptions_total",
        "dsv4_operator_reconcile_total", "dsv4_operator_reconcile_duration_seconds_bucket",
    }  # fmt: skip
    assert asked <= used, asked - used
    for p in panels():
        if "quantile" in json.dumps(p["targets"]) and "operator" not in p["title"].lower():
            assert any("0.99" in t["expr"] for t in p["targets"]), p["title"]  # percentiles include p99


def test_engine_queries_follow_the_deployment_variable_and_split_by_deployment() -> None:
    for title, expr in queries():
        if series_in(expr) <= {n for n in known_series() if n.startswith("dsv4_operator_")}:
            continue  # the operator's process-wide figures
        assert '=~"$deployment"' in expr and '=~"$namespace"' in expr, title
        assert re.search(r"by \([^)]*dsv4_deployment", expr), title


def test_the_operators_series_are_documented() -> None:
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in metrics.REGISTRY.collect()}
    section = DOC.read_text().split("## The operator's series", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z0-9_:]+)` \|", section, flags=re.MULTILINE))
    assert exported == documented


def test_every_pd_failure_reason_the_code_raises_starts_at_zero() -> None:
    """The PD failures panel has data before any failure because each reason's counter starts at 0:
    the list must hold every reason disagg/ raises."""
    from dsv4_engine.server.metrics import PD_FAILURE_REASONS

    code = "\n".join(p.read_text() for p in (ROOT / "engine" / "dsv4_engine" / "disagg").glob("*.py"))
    raised = set(re.findall(r'PdError\(\s*"([a-z_]+)"', code))
    raised |= set(re.findall(r'pd_failures\.labels\("([a-z_]+)"\)', code))
    assert len(raised) >= 10
    assert raised <= set(PD_FAILURE_REASONS), sorted(raised - set(PD_FAILURE_REASONS))


def test_every_pd_write_path_the_code_takes_starts_at_zero() -> None:
    """dsv4_pd_transfer_writes_total{path} has a series for every path before the first write: the
    list holds every label transfer.path_label gives a path of transfer.PATHS, and nothing else."""
    from dsv4_engine.disagg.transfer import PACKING, PATHS, path_label
    from dsv4_engine.server.metrics import PD_WRITE_PATHS, ServerMetrics

    labels = {path_label(p, 1) for p in PATHS} | {path_label(p, 2) for p in PACKING}
    assert labels == set(PD_WRITE_PATHS), sorted(labels ^ set(PD_WRITE_PATHS))
    text = ServerMetrics(dict).render().decode()
    for path in PD_WRITE_PATHS:
        assert f'dsv4_pd_transfer_writes_total{{path="{path}"}} 0.0' in text, path
