"""`dsv4 up` with no spec serves the bundled demo model, and its PD answer is the colocated one: a
256-token greedy chat completion through the router (prefill -> Mooncake -> decode) equals, token for
token, what one colocated `dsv4 serve` on the same checkpoint writes, and reads like the training text."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai

from dsv4_engine import demo
from dsv4_operator.up import BUNDLED_SPEC

QUESTION = [{"role": "user", "content": 'What is the "try" statement?'}]
TOKENS = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answer(base_url: str, model: str) -> tuple[str, int]:
    c = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300)
    reply = c.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    return reply.choices[0].message.content or "", reply.usage.completion_tokens


def healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_up_serves_the_demo_model_and_pd_writes_what_colocated_writes(
    up: Any, until: Any, tmp_path: Path
) -> None:
    run = up(BUNDLED_SPEC)
    url = run.endpoint()
    assert f"model {demo.BUNDLED}" in run.output, run.output  # resolved to the bundled checkpoint
    pd_text, pd_tokens = answer(url, "dsv4-tiny")

    port = free_port()
    log = (tmp_path / "colocated.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from dsv4_operator.cli import main; sys.exit(main())", "serve",
         "--model", str(demo.BUNDLED), "--served-model-name", "demo", "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        until(lambda: healthy(base) or server.poll() is not None, 240, "the colocated server to load")
        assert server.poll() is None, (tmp_path / "colocated.log").read_text()
        colocated_text, colocated_tokens = answer(f"{base}/v1", "demo")
    finally:
        server.terminate()
        server.wait(60)
        log.close()

    assert pd_tokens == colocated_tokens == TOKENS
    assert pd_text == colocated_text
    found = demo.words(pd_text)
    vocabulary = demo.training_words(demo.load_corpus())
    assert len(found) > 40 and sum(w in vocabulary for w in found) >= 0.7 * len(found), pd_text
