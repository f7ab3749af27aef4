"""`dsv4 serve --metrics-port`: a second listener that serves /metrics and nothing else, so a
NetworkPolicy can admit a scraper to it without opening the API; /metrics stays on --port too."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4_engine.server import main as serve_main
from dsv4_engine.server.app import create_app
from dsv4_engine.server.args import parse


def test_metrics_port_serves_metrics_only_and_the_main_port_keeps_them(
    settings_factory: Callable[..., Any],
    fake_engine_cls: Any,
    tokenizer: Any,
    serve: Callable[..., Any],
    free_port_factory: Callable[[], int],
) -> None:
    mport = free_port_factory()
    app = create_app(settings_factory(metrics_port=mport), lambda: fake_engine_cls(tokenizer))
    with serve(app) as base:
        side = f"http://127.0.0.1:{mport}"
        got = httpx.post(
            f"{base}/v1/completions", json={"model": "dsv4-tiny", "prompt": "hi", "max_tokens": 3}, timeout=30
        )
        assert got.status_code == 200, got.text
        on_side = httpx.get(f"{side}/metrics", timeout=5)
        assert on_side.status_code == 200
        assert on_side.headers["content-type"].startswith("text/plain")
        for body in (on_side.text, httpx.get(f"{base}/metrics", timeout=5).text):
            assert 'vllm:request_success_total{finished_reason="length",model_name="dsv4-tiny"' in body
            assert "dsv4_server_ready 1.0" in body
        for path, method in (("/v1/completions", "POST"), ("/health", "GET"), ("/v1/models", "GET")):
            assert httpx.request(method, f"{side}{path}", timeout=5).status_code == 404, path
        assert httpx.get(f"{side}/docs", timeout=5).status_code == 404
    with pytest.raises(httpx.ConnectError):  # the side listener stops with the server
        httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=5)


def test_metrics_port_must_differ_from_the_other_ports(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["--model", "m", "--metrics-port", "9100"]).metrics_port == 9100
    assert parse(["--model", "m"]).metrics_port is None
    for argv in (["--port", "9100"], ["--bootstrap-port", "9100"]):
        with pytest.raises(SystemExit):
            parse(["--model", "m", "--metrics-port", "9100", *argv])
        assert "--metrics-port must differ" in capsys.readouterr().err


def test_a_metrics_port_in_use_fails_the_start(
    tiny_checkpoint: Path, free_port_factory: Callable[[], int], caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        argv = ["--model", str(tiny_checkpoint), "--device", "cpu", "--port", str(free_port_factory())]
        with pytest.raises(SystemExit) as exited:  # uvicorn's answer to a failed startup
            serve_main.main([*argv, "--metrics-port", str(busy)])
    assert exited.value.code not in (0, None)
    assert f"cannot listen on 127.0.0.1:{busy}" in caplog.text
