"""`dsv4 serve` as a process: SIGTERM drains (503 for new work, in-flight completes) and exits 0.

The in-flight request is held open by pausing the engine between steps (the DSV4_TEST_HOOKS routes),
so the draining server is probed while the request is certainly unfinished, however fast or loaded
the machine is; resuming lets it run to its end.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx

TOKENS = 48
NAME = "tiny"


def test_sigterm_drains_then_exits_zero(tiny_checkpoint: Path, serve_process: Any, until: Any) -> None:
    server = serve_process(
        "--model", str(tiny_checkpoint), "--served-model-name", NAME, "--grace-period", "300",
        env={"DSV4_TEST_HOOKS": "1"},
    )  # fmt: skip
    proc, base = server.proc, server.base
    assert httpx.post(f"{base}/debug/pause", timeout=120).json()["paused"]
    result: dict[str, Any] = {"events": []}

    def in_flight() -> None:
        body = {
            "model": NAME,
            "prompt": "Drain me",
            "max_tokens": TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    result["events"].append(line[6:])

    worker = threading.Thread(target=in_flight)
    worker.start()
    until(
        lambda: httpx.get(f"{base}/debug/state", timeout=5).json()["open"] == 1,
        60,
        "the request to reach the engine",
    )
    proc.send_signal(signal.SIGTERM)
    until(
        lambda: httpx.get(f"{base}/health", timeout=5).status_code == 503,
        60,
        "/health to report draining",
    )
    assert httpx.get(f"{base}/health").json()["status"] == "draining"
    refused = httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": "late", "max_tokens": 1})
    assert refused.status_code == 503
    assert refused.headers["Retry-After"]
    assert worker.is_alive(), "the in-flight request ended while the engine was paused"
    assert proc.poll() is None, "the server exited with a request in flight"

    httpx.post(f"{base}/debug/resume", timeout=10).raise_for_status()
    worker.join(600)
    assert result["status"] == 200 and result["events"][-1] == "[DONE]"
    usage = json.loads(result["events"][-2])["usage"]
    assert usage["completion_tokens"] == TOKENS  # it ran to the end, not aborted
    finals = [json.loads(e)["choices"][0]["finish_reason"] for e in result["events"][:-2]]
    assert finals[-1] == "length"
    assert proc.wait(120) == 0, server.log()
    assert "draining" in server.log()
