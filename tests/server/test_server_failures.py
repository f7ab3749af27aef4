"""Failure paths driven by a scriptable engine: engine death, full queue, disconnects, drain, auth."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from dsv4_engine.server.app import create_app

COMPLETION = {"model": "dsv4-tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0.0}


@pytest.fixture
def fake(tokenizer: Any, fake_engine_cls: Any) -> Any:
    return fake_engine_cls(tokenizer)


@pytest.fixture
def slow(tokenizer: Any, fake_engine_cls: Any) -> Any:
    return fake_engine_cls(tokenizer, step_delay=0.005)


def _pages_whole(engine: Any) -> bool:
    return engine.free_pages == engine.total_pages and not engine.has_unfinished()


def test_engine_failure_fails_requests_and_health(fake: Any, settings_factory: Any, serve: Any) -> None:
    with serve(create_app(settings_factory(), lambda: fake)) as base:
        assert httpx.post(f"{base}/v1/completions", json=COMPLETION).status_code == 200
        fake.fail_next_step = True
        r = httpx.post(f"{base}/v1/completions", json=COMPLETION, timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable"
        health = httpx.get(f"{base}/health")
        assert (health.status_code, health.json()["status"]) == (503, "dead")
        again = httpx.post(f"{base}/v1/completions", json=COMPLETION)
        assert again.status_code == 503 and "Retry-After" in again.headers


def test_full_queue_answers_503_with_retry_after(
    fake: Any, settings_factory: Any, serve: Any, until: Any
) -> None:
    engine = fake
    with serve(create_app(settings_factory(max_waiting=2), lambda: engine)) as base:
        engine.gate.clear()  # nothing gets scheduled: requests pile up as waiting
        results: list[int] = []

        def send() -> None:
            results.append(httpx.post(f"{base}/v1/completions", json=COMPLETION, timeout=60).status_code)

        threads = [threading.Thread(target=send) for _ in range(2)]
        for t in threads:
            t.start()
        until(lambda: len(engine.waiting) == 2, 30, "two requests queued")
        full = httpx.post(f"{base}/v1/completions", json=COMPLETION)
        assert full.status_code == 503
        assert full.json()["error"]["code"] == "queue_full"
        assert int(full.headers["Retry-After"]) >= 1
        engine.gate.set()
        for t in threads:
            t.join(60)
        assert results == [200, 200]
        metrics = httpx.get(f"{base}/metrics").text
        assert 'dsv4_requests_rejected_total{reason="queue_full"} 1.0' in metrics


def test_stream_disconnect_aborts_in_engine(slow: Any, settings_factory: Any, serve: Any, until: Any) -> None:
    engine = slow
    with serve(create_app(settings_factory(), lambda: engine)) as base:
        body = {**COMPLETION, "max_tokens": 200, "stream": True}
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", f"{base}/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        # The connection is closed mid-stream; the server must abort the request and free its page.
        until(lambda: _pages_whole(engine), 30, "the aborted request to release its pages")
        assert len(engine.aborted) >= 1
        assert engine.generated < 200 + 10  # it did not run to completion (the warm-up made a few)


def test_non_stream_disconnect_aborts_in_engine(
    slow: Any, settings_factory: Any, serve: Any, until: Any
) -> None:
    engine = slow
    with serve(create_app(settings_factory(), lambda: engine)) as base:
        before = len(engine.aborted)

        async def give_up() -> None:
            async with httpx.AsyncClient() as client:
                task = asyncio.ensure_future(
                    client.post(f"{base}/v1/completions", json={**COMPLETION, "max_tokens": 200})
                )
                await asyncio.to_thread(until, lambda: engine.running, 30, "the request to run")
                task.cancel()  # closes the connection
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(give_up())
        until(lambda: _pages_whole(engine) and len(engine.aborted) > before, 30, "abort after disconnect")


def test_drain_aborts_after_grace(slow: Any, settings_factory: Any, serve: Any, until: Any) -> None:
    engine = slow
    app = create_app(settings_factory(grace_period=0.3), lambda: engine)
    with serve(app) as base:
        result: dict[str, Any] = {}

        def long_request() -> None:
            result["r"] = httpx.post(
                f"{base}/v1/completions", json={**COMPLETION, "max_tokens": 200}, timeout=60
            )

        t = threading.Thread(target=long_request)
        t.start()
        until(lambda: engine.running, 30, "the request to run")
        ctx = app.state.ctx
        fut = asyncio.run_coroutine_threadsafe(ctx.drain(0.3), ctx.bridge._loop)
        until(lambda: httpx.get(f"{base}/health").status_code == 503, 10, "health to turn 503")
        assert httpx.post(f"{base}/v1/completions", json=COMPLETION).status_code == 503
        fut.result(30)
        t.join(30)
        assert result["r"].status_code == 200
        assert result["r"].json()["choices"][0]["finish_reason"] == "abort"
        until(lambda: _pages_whole(engine), 30, "pages after drain")


def test_api_key(fake: Any, settings_factory: Any, serve: Any) -> None:
    with serve(create_app(settings_factory(api_key="s3cret"), lambda: fake)) as base:
        assert httpx.get(f"{base}/health").status_code == 200  # probes carry no key
        denied = httpx.post(f"{base}/v1/completions", json=COMPLETION)
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = httpx.post(f"{base}/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_request_id_echoed(fake: Any, settings_factory: Any, serve: Any) -> None:
    with serve(create_app(settings_factory(), lambda: fake)) as base:
        r = httpx.post(f"{base}/v1/completions", json=COMPLETION, headers={"x-request-id": "abc-123"})
        assert r.headers["x-request-id"] == "abc-123"
        bad = httpx.get(f"{base}/v1/models", headers={"x-request-id": "evil\tvalue"})
        assert bad.headers["x-request-id"] != "evil\tvalue" and len(bad.headers["x-request-id"]) == 32
        assert len(httpx.get(f"{base}/health").headers["x-request-id"]) == 32


def test_health_503_until_loaded(fake: Any, settings_factory: Any, serve: Any, until: Any) -> None:
    release = threading.Event()

    def slow_factory() -> Any:
        release.wait(60)
        return fake

    with serve(create_app(settings_factory(), slow_factory), wait_ready=False) as base:
        r = httpx.get(f"{base}/health")
        assert (r.status_code, r.json()["status"]) == (503, "loading")
        busy = httpx.post(f"{base}/v1/completions", json=COMPLETION)
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "5"
        release.set()
        until(lambda: httpx.get(f"{base}/health").status_code == 200, 30, "ready")
        assert fake.steps >= 1  # the warm-up step ran before /health said ready


def test_event_loop_answers_while_a_step_runs(fake: Any, settings_factory: Any, serve: Any) -> None:
    with serve(create_app(settings_factory(), lambda: fake)) as base:
        fake.stall.set()
        result: dict[str, Any] = {}
        t = threading.Thread(
            target=lambda: result.update(r=httpx.post(f"{base}/v1/completions", json=COMPLETION))
        )
        t.start()
        assert fake.stalled.wait(30), "the engine never entered a step"
        # The engine thread is inside step(); HTTP must still be served (timeouts make a hang fail).
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
        assert httpx.get(f"{base}/get_load", timeout=10).json()[0]["num_reqs"] >= 1
        fake.stall.clear()
        fake.resume.set()
        t.join(30)
        assert result["r"].status_code == 200


def test_the_thread_that_builds_the_engine_steps_it(
    fake: Any, settings_factory: Any, serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine is built and stepped on one thread, neither the main thread nor the event loop's: a
    second thread computing makes a second OpenMP pool, which made CPU steps ~1.5x slower
    (bridge.EngineThread)."""
    built: list[int] = []
    stepped: set[int] = set()
    step = fake.step

    def recording_step() -> Any:
        stepped.add(threading.get_ident())
        return step()

    monkeypatch.setattr(fake, "step", recording_step)

    def factory() -> Any:
        built.append(threading.get_ident())
        return fake

    with serve(create_app(settings_factory(), factory)) as base:  # ready: the warm-up has stepped
        assert httpx.post(f"{base}/v1/completions", json=COMPLETION, timeout=30).status_code == 200
    assert len(built) == 1 and stepped == set(built), (built, stepped)
    assert built[0] not in (threading.main_thread().ident, threading.get_ident())


def test_pd_fields_need_a_pd_role(fake: Any, settings_factory: Any, serve: Any) -> None:
    with serve(create_app(settings_factory(), lambda: fake)) as base:
        r = httpx.post(f"{base}/v1/completions", json={**COMPLETION, "bootstrap_room": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room"
        assert httpx.get(f"{base}/v1/models/dsv4-tiny").json()["id"] == "dsv4-tiny"
        assert httpx.get(f"{base}/v1/models/other").json()["error"]["code"] == "model_not_found"


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4_engine.server.args import parse

    monkeypatch.setenv("DSV4_API_KEY", "from-env")
    assert parse(["--model", "m"]).api_key == "from-env"
    assert parse(["--model", "m", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("DSV4_API_KEY")
    assert parse(["--model", "m"]).api_key is None


def test_enforce_eager_flag_reaches_the_engine() -> None:
    from dsv4_engine.server.args import parse

    assert "enforce_eager" not in parse(["--model", "m"]).engine_kwargs()  # the engine's default: eager
    assert parse(["--model", "m", "--no-enforce-eager"]).engine_kwargs()["enforce_eager"] is False
