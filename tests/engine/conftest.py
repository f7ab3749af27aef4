"""Fixtures for the engine tests: tiny checkpoints, HF references, engines built on demand."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dsv4_engine.llm import LLM

MAX_MODEL_LEN = 2048


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread (see dsv4_engine.testing.one_thread)."""


@pytest.fixture(scope="session")
def make_llm(checkpoints: dict[str, Path]) -> Callable[..., LLM]:
    """LLM(checkpoint name, **engine kwargs), fp32 on CPU; small pools unless told otherwise."""

    def make(name: str = "A", **kwargs: object) -> LLM:
        kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
        kwargs.setdefault("max_num_seqs", 16)
        kwargs.setdefault("num_pages", 256)
        return LLM(checkpoints[name], dtype="float32", device="cpu", **kwargs)

    return make


def _assert_released(llm: LLM) -> None:
    # No request holds a page: each is free or held by the prefix cache alone, and flushing the cache
    # frees them all.
    pools, available = llm.engine.allocator.pools, llm.engine.allocator.num_available()
    assert all(available[fam] == pools[fam].num_pages for fam in pools), available
    llm.engine.flush_cache()
    m = llm.engine.metrics()
    for fam in ("full", "swa", "c4s", "c128s"):
        assert m[f"pool_total/{fam}"] > 0, fam
        assert m[f"pool_free/{fam}"] == m[f"pool_total/{fam}"], fam
        assert m[f"pool_usage/{fam}"] == 0.0, fam
    slots = llm.engine.allocator.snapshot_slots  # the snapshots' C4 state rows
    assert slots.num_free == slots.num_pages, (slots.num_free, slots.num_pages)
    assert llm.engine.allocator.num_free_requests() == llm.engine.max_num_seqs
    assert m["num_running"] == 0 and m["num_waiting"] == 0 and not llm.engine.requests


@pytest.fixture
def assert_released() -> Callable[[LLM], None]:
    """Checks every page family and every request row is back at its initial free count."""
    return _assert_released


def _record_chunks(llm: LLM) -> list[tuple[str, int, int]]:
    """Record (request id, start, end) of every chunk the engine's scheduler schedules from now on."""
    sched = llm.engine.scheduler
    log: list[tuple[str, int, int]] = []
    schedule = sched.schedule

    def recording():  # type: ignore[no-untyped-def]
        out = schedule()
        if out is not None:
            log.extend((c.seq.request_id, c.start, c.end) for c in out.chunks)
        return out

    sched.schedule = recording  # type: ignore[method-assign]
    return log


@pytest.fixture
def record_chunks() -> Callable[[LLM], list[tuple[str, int, int]]]:
    return _record_chunks
