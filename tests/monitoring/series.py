"""The series a query may name: docs/observability.md's tables (every series `dsv4 serve` and the
operator export), with a histogram's _bucket/_sum/_count, and Prometheus' own `up`; and the series
names a PromQL expression uses."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
_ROW = re.compile(r"^\| `([a-z0-9_:]+)` \| (counter|gauge|histogram) \|", re.MULTILINE)
_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "offset", "inf", "nan",
}  # fmt: skip
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def known_series() -> set[str]:
    out = {"up"}
    for name, kind in _ROW.findall(DOC.read_text()):
        out.add(name)
        if kind == "histogram":
            out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return out


def series_in(expr: str) -> set[str]:
    """Metric names in a PromQL expression (functions, keywords, labels and durations left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "{}", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "[]", text)  # ranges and subqueries
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables ($__rate_interval, ${deployment})
    names = set()
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names
