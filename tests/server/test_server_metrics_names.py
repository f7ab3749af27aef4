"""The `vllm:*` series beside the `dsv4_*` ones: the same data, vLLM's names and labels, and every
series the server exports listed in docs/observability.md (and nothing listed that it does not)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsv4_engine.server.metrics import (
    ServerMetrics,
    kv_cache_usage,
    prefix_cache_hit_rate,
    spec_decode_acceptance_rate,
    spec_decode_mean_acceptance_length,
)
from prometheus_util import samples  # tests/ is on sys.path (tests/conftest.py)

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def rendered(snapshot: dict[str, float], role: str = "decode") -> ServerMetrics:
    m = ServerMetrics(lambda: snapshot, model_name="tiny", role=role)
    for seconds in (0.02, 0.3, 7.0):
        m.ttft.observe(seconds)
        m.itl.observe(seconds / 10)
        m.e2e.observe(seconds * 3)
    m.finished.labels("stop").inc(2)
    m.finished.labels("length").inc()
    return m


def test_vllm_series_carry_the_same_values_with_model_and_role(llm: Any) -> None:
    snap = {**llm.engine.metrics(), "num_running": 3, "num_waiting": 2, "prompt_tokens_total": 41}
    snap.update(prefix_cache_queries=40, prefix_cache_hits=10)
    snap.update(
        spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30, spec_decode_num_accepted_tokens=12
    )
    got = samples(rendered(snap).render().decode())
    extra = (("model_name", "tiny"), ("role", "decode"))
    pairs = {
        "dsv4_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
        "dsv4_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
        "dsv4_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    }
    checked = 0
    for (name, labels), value in got.items():
        for ours, theirs in pairs.items():
            if name.startswith(ours):
                twin = (theirs + name[len(ours) :], tuple(sorted(labels + extra)))
                assert got[twin] == value, twin
                checked += 1
    assert checked >= 3 * 3  # every histogram's buckets, sum and count
    for reason in ("stop", "length"):
        ours = got[("dsv4_requests_finished_total", (("finish_reason", reason),))]
        theirs = got[("vllm:request_success_total", tuple(sorted((("finished_reason", reason), *extra))))]
        assert ours == theirs > 0
    for ours, theirs in (
        ("dsv4_num_requests_running", "vllm:num_requests_running"),
        ("dsv4_num_requests_waiting", "vllm:num_requests_waiting"),
        ("dsv4_prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("dsv4_generation_tokens_total", "vllm:generation_tokens_total"),
        ("dsv4_preemptions_total", "vllm:num_preemptions_total"),
        ("dsv4_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
        ("dsv4_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
        ("dsv4_spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"),
        ("dsv4_spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
        ("dsv4_spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"),
    ):
        assert got[(ours, ())] == got[(theirs, extra)], theirs
    assert got[("vllm:num_requests_running", extra)] == 3
    assert got[("vllm:prefix_cache_hits_total", extra)] == 10
    assert got[("dsv4_prefix_cache_hit_rate", ())] == 0.25
    assert got[("vllm:spec_decode_num_accepted_tokens_total", extra)] == 12
    assert got[("dsv4_spec_decode_acceptance_rate", ())] == 0.4
    assert got[("dsv4_spec_decode_mean_acceptance_length", ())] == 2.2
    usage = got[("vllm:kv_cache_usage_perc", extra)]
    assert usage == got[("vllm:gpu_cache_usage_perc", extra)] == kv_cache_usage(snap)


def test_prefix_cache_hit_rate_is_hits_over_queries() -> None:
    assert prefix_cache_hit_rate({"prefix_cache_queries": 8.0, "prefix_cache_hits": 2.0}) == 0.25
    assert prefix_cache_hit_rate({}) == 0.0  # no prompt admitted yet: 0, not a division by zero


def test_spec_decode_gauges_are_accepted_over_drafted_and_one_plus_accepted_per_step() -> None:
    snap = {
        "spec_decode_num_drafts": 4.0,
        "spec_decode_num_draft_tokens": 8.0,
        "spec_decode_num_accepted_tokens": 6.0,
    }
    assert spec_decode_acceptance_rate(snap) == 0.75
    assert spec_decode_mean_acceptance_length(snap) == 2.5  # the target's token plus 1.5 kept drafts a step
    # Nothing drafted yet (or speculation off): 0, not a division by zero.
    assert spec_decode_acceptance_rate({}) == spec_decode_mean_acceptance_length({}) == 0.0


def test_kv_usage_is_the_fullest_page_family() -> None:
    snap = {"pool_usage/full": 0.25, "pool_usage/swa": 0.75, "pool_usage/c4s": 0.5, "pool_free/full": 9.0}
    assert kv_cache_usage(snap) == 0.75
    assert kv_cache_usage({}) == 0.0


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_each_role_labels_its_series(role: str) -> None:
    text = rendered({"prompt_tokens_total": 5}, role=role).render().decode()
    assert f'vllm:prompt_tokens_total{{model_name="tiny",role="{role}"}} 5.0' in text


def test_every_exported_series_is_documented_and_every_documented_one_exported(llm: Any) -> None:
    exported = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in text_string_to_metric_families(rendered(dict(llm.engine.metrics())).render().decode())
    }
    section = DOC.read_text().split("## Every series", 1)[1].split("\n## ", 1)[0]  # the server's table
    documented = set(re.findall(r"^\| `([a-z0-9_:]+)` \|", section, flags=re.MULTILINE))
    assert exported - documented == set(), "exported but not in docs/observability.md"
    assert documented - exported == set(), "documented but not exported"
