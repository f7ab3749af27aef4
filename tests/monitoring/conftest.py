"""Fixtures for the monitoring tests: Debian's `prometheus` package binaries (promtool, prometheus),
installed by scripts/setup.sh. Absent, the tests that need them skip saying so, unless the run is strict
(tests/suite/skips.py: then they fail)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from suite import skips

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dsv4-operator"
ALERTS = CHART / "files" / "alerts.yaml"
DASHBOARD = CHART / "files" / "dashboard.json"


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    why = f"no {name} binary: install Debian's prometheus package (scripts/setup.sh: apt-get install prometheus)"
    skips.missing(why)


@pytest.fixture(scope="session")
def promtool() -> str:
    return _binary("promtool")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    return _binary("prometheus")
