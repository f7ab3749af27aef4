"""The alert rules (charts/dsv4-operator/files/alerts.yaml): promtool accepts them, and its unit tests
(alerts_test.yaml) fire and clear every alert; every alert has such a test, and reads only series that
exist (docs/observability.md's table and the operator's own)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from .conftest import ALERTS
from .series import known_series, series_in

TESTS = Path(__file__).with_name("alerts_test.yaml")


def alerts() -> dict[str, str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {r["alert"]: r["expr"] for g in groups for r in g["rules"] if "alert" in r}


def test_promtool_accepts_the_rules(promtool: str) -> None:
    proc = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in proc.stdout


def test_promtool_unit_tests_fire_and_clear_each_alert(promtool: str) -> None:
    proc = subprocess.run(
        [promtool, "test", "rules", TESTS.name], cwd=TESTS.parent, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_is_tested_firing_and_cleared() -> None:
    fired: set[str] = set()
    cleared: set[str] = set()
    for case in yaml.safe_load(TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else cleared).add(check["alertname"])
    assert set(alerts()) == fired == cleared
    assert {"Dsv4PdTransferFailures", "Dsv4RoleNoReadyPods", "Dsv4KvCacheNearFull", "Dsv4TtftP99High",
            "Dsv4DeploymentDegraded"} <= set(alerts())  # fmt: skip


def test_alerts_read_only_series_that_exist() -> None:
    known = known_series()
    for name, expr in alerts().items():
        used = series_in(expr)
        assert used, name
        assert used <= known, (name, used - known)
