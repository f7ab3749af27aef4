"""Agent tooling against `dsv4 up` (prefill, decode and sglang-router 0.3.2 on 127.0.0.1).

- The `openai-agents` SDK runs its two-tool task (tests/server/agent_task.py) through the router over
  chat completions, which the router routes to the PD pair.
- sglang-router 0.3.2 answers `/v1/responses` itself, in PD mode, with 501 "Responses endpoint not
  implemented": it never forwards it. The servers serve the route, PD included: sent the way the
  router sends chat requests (the same body, with one bootstrap room, to the prefill and the decode
  server), a Responses request gets the decode server's answer, which equals the chat answer
  through the router. docs/server.md says how to reach it.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a page?"}]


def _agent_task() -> Any:
    path = ROOT / "tests" / "server" / "agent_task.py"
    spec = importlib.util.spec_from_file_location("server_agent_task", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic looks the module up while it builds the models
    spec.loader.exec_module(module)
    return module


def _pd_post(prefill: str, decode: str, path: str, body: dict[str, Any]) -> httpx.Response:
    """What sglang-router does with a chat request, for another route: one room, both servers."""
    bootstrap = httpx.get(f"{prefill}/server_info", timeout=10).json()["disaggregation_bootstrap_port"]
    room = random.getrandbits(63)
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": room}
    with ThreadPoolExecutor(2) as pool:
        sent = [
            pool.submit(httpx.post, f"{url}{path}", json={**body, **fields}, timeout=300)
            for url in (prefill, decode)
        ]
        prefill_answer, decode_answer = (f.result() for f in sent)
    assert prefill_answer.status_code == 200, prefill_answer.text
    return decode_answer


def test_agents_and_responses_through_up(tiny_model: Path, spec_for: Any, up: Any) -> None:
    run = up(spec_for(tiny_model))
    url = run.endpoint()
    children = run.children()

    task = _agent_task()
    result, called = task.run_agent(url, "dsv4-tiny", api="chat_completions")
    task.check_run(result, called)

    r = httpx.post(f"{url}/responses", json={"model": "dsv4-tiny", "input": "hi"}, timeout=60)
    assert r.status_code == 501 and "not implemented" in r.text, (r.status_code, r.text)

    greedy = {"max_tokens": 8, "temperature": 0}
    chat = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=300)
    want = chat.chat.completions.create(model="dsv4-tiny", messages=CHAT, **greedy).choices[0].message.content
    body = {"model": "dsv4-tiny", "instructions": "Be brief.", "input": "What is a page?"}
    body |= {"max_output_tokens": 8, "temperature": 0}
    got = _pd_post(children["prefill-0"][1], children["decode-0"][1], "/v1/responses", body)
    assert got.status_code == 200, got.text
    out = got.json()
    assert out["object"] == "response" and out["output"][0]["content"][0]["text"] == want
