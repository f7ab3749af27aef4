"""What the server tests read off a running server: its `/metrics` as samples, and an `openai` client
(tests/ is on sys.path: tests/conftest.py)."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

# (series name with its suffix, sorted labels) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample of a Prometheus text exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(base: str) -> Samples:
    """The server's /metrics at `base`, as samples."""
    r = httpx.get(f"{base}/metrics", timeout=30)
    r.raise_for_status()
    return samples(r.text)


def openai_client(base: str) -> openai.OpenAI:
    """The official client on the server's /v1, no retries: a test sees every failure."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
