"""sglang-router 0.3.2 in front of the server: it registers the worker and its rewritten requests work.

The router discovers the worker through /health, /server_info and /model_info, then re-serialises
every request with its own defaults (`logprobs: false`, `skip_special_tokens: true`, `model: null` on
/generate, `model: "unknown"` when the client sent none, ...). Answers through the router must equal
answers from the server directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dsv4_engine.server.app import create_app
from dsv4_engine.server.args import ServerSettings

NAME = "routed"
CHAT = [{"role": "user", "content": "Route me"}]
GREEDY = {"max_tokens": 5, "temperature": 0}


@pytest.fixture(scope="module")
def worker(llm: Any, tiny_checkpoint: Path, serve: Any) -> Iterator[str]:
    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME)
    with serve(create_app(settings, lambda: llm.engine)) as base:
        yield base


@pytest.fixture(scope="module")
def router(
    worker: str, tmp_path_factory: pytest.TempPathFactory, free_port_factory: Any, until: Any
) -> Iterator[str]:
    port, metrics_port = free_port_factory(), free_port_factory()
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", worker]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port)]
    cmd += ["--policy", "round_robin"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"

    def registered() -> bool:
        assert proc.poll() is None, log_path.read_text()[-4000:]
        try:
            models = httpx.get(f"{base}/v1/models", timeout=2)
        except httpx.HTTPError:
            return False
        return models.status_code == 200 and NAME in models.text

    try:
        until(registered, 60, "sglang-router to register the worker")
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def test_requests_through_router_equal_direct(worker: str, router: str) -> None:
    direct = openai.OpenAI(base_url=f"{worker}/v1", api_key="x", max_retries=0, timeout=120)
    routed = openai.OpenAI(base_url=f"{router}/v1", api_key="x", max_retries=0, timeout=120)
    want_chat = direct.chat.completions.create(model=NAME, messages=CHAT, **GREEDY).choices[0].message.content
    got_chat = routed.chat.completions.create(model=NAME, messages=CHAT, **GREEDY)
    assert got_chat.choices[0].message.content == want_chat
    want = direct.completions.create(model=NAME, prompt="Route me", **GREEDY).choices[0].text
    assert routed.completions.create(model=NAME, prompt="Route me", **GREEDY).choices[0].text == want
    stream = routed.chat.completions.create(model=NAME, messages=CHAT, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_chat


def test_router_defaults_and_generate(worker: str, router: str) -> None:
    # No model: the router forwards "unknown", which means this server's model.
    r = httpx.post(f"{router}/v1/chat/completions", json={"messages": CHAT, **GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    body = {"text": "Route me", "sampling_params": {"max_new_tokens": 5, "temperature": 0.0}}
    want = httpx.post(f"{worker}/generate", json=body, timeout=120).json()
    got = httpx.post(f"{router}/generate", json=body, headers={"x-request-id": "trace-42"}, timeout=120)
    assert got.status_code == 200, got.text
    assert got.json()["output_ids"] == want["output_ids"] and got.json()["text"] == want["text"]
