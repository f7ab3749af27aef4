"""`dsv4 up` end to end: one prefill, one decode and the router on 127.0.0.1, asked through the router
with the official openai client; SIGTERM with a stream in flight drains it and exits 0; a process
that dies stops the rest and exits 1 with its last log lines.

The in-flight stream is held open by pausing the decode server's engine between steps (the
DSV4_TEST_HOOKS routes, which dsv4 up's children inherit), so the drain is observed while the
request is certainly unfinished.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import yaml

CHAT = [{"role": "user", "content": "Say hello to the cluster."}]
TOKENS = 12
HELD_TOKENS = 24


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)


def engine(base: str) -> dict[str, Any]:
    return httpx.get(f"{base}/debug/state", timeout=10).json()["engine"]


def health(base: str) -> int:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def _structured_through_pd(c: openai.OpenAI) -> None:
    """The grammar starts on the prefill server (first token) and continues on the decode server."""
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    kw: dict[str, Any] = {"model": "dsv4-tiny", "messages": CHAT, "max_tokens": 120, "seed": 1}
    r = c.chat.completions.create(**kw, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    chunks = [ch for ch in c.chat.completions.create(**kw, response_format=fmt, stream=True) if ch.choices]
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks)), PERSON)
    tools = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    r = c.chat.completions.create(**kw, **tools)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    history = [
        *CHAT,
        r.choices[0].message.model_dump(exclude_unset=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    assert c.chat.completions.create(**{**kw, "messages": history}, tools=[WEATHER]).choices
    thinking = {"chat_template_kwargs": {"thinking": True}}
    r = c.chat.completions.create(**{**kw, "max_tokens": 8}, extra_body=thinking)
    assert getattr(r.choices[0].message, "reasoning_content", None)
    streamed = c.chat.completions.create(**{**kw, "max_tokens": 8}, extra_body=thinking, stream=True)
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in streamed)
    assert reasoning == r.choices[0].message.reasoning_content


def test_up_serves_through_the_router_and_drains_on_sigterm(
    tiny_model: Path, spec_for: Any, up: Any, until: Any, alive: Any
) -> None:
    run = up(spec_for(tiny_model))
    url = run.endpoint()
    children = run.children()
    assert set(children) == {"prefill-0", "decode-0", "router"}
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["dsv4-tiny"]
    greedy = {"max_tokens": TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    reply = c.chat.completions.create(model="dsv4-tiny", messages=CHAT, **greedy)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == TOKENS
    stream = c.chat.completions.create(model="dsv4-tiny", messages=CHAT, stream=True, **greedy)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == (
        reply.choices[0].message.content
    )
    _structured_through_pd(c)

    decode = children["decode-0"][1]
    assert httpx.post(f"{decode}/debug/pause", timeout=120).json()["paused"]
    result: dict[str, Any] = {"pieces": [], "finish": None, "usage": None}

    def in_flight() -> None:
        held = c.chat.completions.create(
            model="dsv4-tiny",
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=HELD_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        for ch in held:
            if ch.choices:
                result["pieces"].append(ch.choices[0].delta.content or "")
                result["finish"] = ch.choices[0].finish_reason or result["finish"]
            if ch.usage:
                result["usage"] = ch.usage.completion_tokens

    worker = threading.Thread(target=in_flight, daemon=True)
    worker.start()
    until(lambda: engine(decode).get("num_running") == 1, 120, "the request to run on the paused decode")
    run.proc.send_signal(signal.SIGTERM)
    run.wait_line(r"decode-0 +stopping", 60)
    until(lambda: health(decode) == 503, 60, "the decode server to drain")
    assert worker.is_alive(), "the stream ended while the decode engine was paused"
    assert run.proc.poll() is None, "dsv4 up exited with a request in flight"
    httpx.post(f"{decode}/debug/resume", timeout=30).raise_for_status()
    worker.join(180)
    assert not worker.is_alive()
    assert result["usage"] == HELD_TOKENS and result["finish"] == "length"  # ran to its end, not aborted
    assert run.wait(180) == 0, run.output
    assert "dsv4 up: stopped" in run.output
    assert not [name for name, (pid, _) in children.items() if alive(pid)]


def test_a_server_failing_to_load_stops_everything_with_its_log(
    tmp_path: Path, spec_for: Any, up: Any, alive: Any
) -> None:
    bogus = tmp_path / "bogus"
    bogus.mkdir()
    (bogus / "config.json").write_text("{}")  # a checkpoint directory the engine cannot load
    run = up(spec_for(bogus))
    assert run.wait(180) == 1, run.output
    out = run.output
    assert "router" not in run.children(), out  # never started: its servers never became healthy
    assert "config has neither" in out, out  # the failing server's own last log lines
    assert not [name for name, (pid, _) in run.children().items() if alive(pid)]


def test_a_process_that_dies_later_stops_the_rest(
    tiny_model: Path, tmp_path: Path, spec_for: Any, up: Any, alive: Any
) -> None:
    run = up(spec_for(tiny_model))
    run.endpoint()
    children = run.children()
    decode_pid = children["decode-0"][0]
    os.kill(decode_pid, signal.SIGKILL)
    assert run.wait(180) == 1, run.output
    out = run.output
    assert "decode-0 exited (killed by SIGKILL) while healthy; last lines of" in out, out
    log = (tmp_path / "logs" / "decode-0.log").read_text().splitlines()
    assert f"  | {log[-1]}" in out  # its last log line, as written
    assert re.search(r"prefill-0 +stopped", out) and re.search(r"router +stopped", out), out
    assert not [name for name, (pid, _) in children.items() if alive(pid)]


def test_up_runs_parallel_servers(tiny_model: Path, spec_for: Any, up: Any, tmp_path: Path) -> None:
    """tensorParallelSize 2 on both roles reaches `dsv4 serve --tp-size 2` unchanged: each server runs
    two ranks, PD pairs them through the router, and the answer is one rank's."""
    from dsv4_engine.llm import LLM
    from dsv4_engine.sampling_params import SamplingParams

    doc = yaml.safe_load(spec_for(tiny_model).read_text())
    for role in ("prefill", "decode"):
        doc["spec"][role]["tensorParallelSize"] = 2
    spec = tmp_path / "tp2.yaml"
    spec.write_text(yaml.safe_dump(doc))
    run = up(spec)
    url = run.endpoint()
    prompt = "The cluster says hello, " * 6
    with LLM(tiny_model) as llm:
        want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))[0]
    got = client(url).completions.create(
        model="dsv4-tiny", prompt=prompt, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == want.text
    for name in ("prefill-0", "decode-0"):
        log = (tmp_path / "logs" / f"{name}.log").read_text()
        assert "rank 1: process groups prewarmed" in log, log[-2000:]  # a second rank ran in it


def prompt_tokens(base: str) -> float:
    """Prompt tokens a server has admitted (vllm:prompt_tokens_total, over its label sets)."""
    from prometheus_util import scrape

    return sum(v for (name, _), v in scrape(base).items() if name == "vllm:prompt_tokens_total")


def two_prefill_servers(
    tiny_model: Path, spec_for: Any, up: Any, tmp_path: Path, policy: str
) -> tuple[openai.OpenAI, list[str]]:
    """`dsv4 up` with 2 prefill servers behind the router's prefill `policy`: a client on it, and the
    prefill servers' URLs."""
    doc = yaml.safe_load(spec_for(tiny_model).read_text())
    doc["spec"]["prefill"]["replicas"] = 2
    doc["spec"]["router"]["prefillPolicy"] = policy
    spec = tmp_path / f"two-prefill-{policy}.yaml"
    spec.write_text(yaml.safe_dump(doc))
    run = up(spec)
    api = client(run.endpoint())  # once the router serves
    prefills = sorted((u for n, (_, u) in run.children().items() if n.startswith("prefill-")))
    assert len(prefills) == 2
    return api, prefills


def test_manual_prefill_policy_keeps_a_conversation_on_one_prefill_server(
    tiny_model: Path, spec_for: Any, up: Any, tmp_path: Path
) -> None:
    """Two prefill servers, `router.prefillPolicy: manual`: every turn of a conversation (one
    X-SMG-Routing-Key) reaches the prefill server its first turn did, so each later turn resumes its
    history from that server's prefix cache. (sglang-router 0.3.2's cache_aware picks a PD prefill
    server at random: the upstream bug docs/foundation.md names.) Random picks would keep all 4
    conversations' 3 turns each together with probability 1/4^4."""
    api, prefills = two_prefill_servers(tiny_model, spec_for, up, tmp_path, "manual")
    served: dict[str, set[str]] = {}
    cached: dict[str, list[int]] = {}
    for conv in ("a", "b", "c", "d"):
        history: list[dict[str, str]] = []
        for turn in range(3):
            history.append(
                {"role": "user", "content": f"Conversation {conv}, turn {turn}: " + "tell me more. " * 40}
            )
            before = [prompt_tokens(u) for u in prefills]
            out = api.chat.completions.create(
                model="dsv4-tiny", messages=history, max_tokens=4, temperature=0,
                extra_headers={"X-SMG-Routing-Key": f"conversation-{conv}"},
            )  # fmt: skip
            grew = [u for u, b in zip(prefills, before, strict=True) if prompt_tokens(u) > b]
            assert len(grew) == 1, (conv, turn, grew)
            served.setdefault(conv, set()).add(grew[0])
            details = out.usage.prompt_tokens_details if out.usage else None
            cached.setdefault(conv, []).append(details.cached_tokens if details else 0)
            history.append({"role": "assistant", "content": out.choices[0].message.content or ""})
    assert all(len(servers) == 1 for servers in served.values()), served
    assert all(c[1] > 0 and c[2] > c[1] for c in cached.values()), cached  # each turn resumed the last


def test_turns_resume_their_history_on_either_prefill_server(
    tiny_model: Path, spec_for: Any, up: Any, tmp_path: Path
) -> None:
    """Two prefill servers behind the default policy (cache_aware, which sglang-router 0.3.2 applies
    to PD prefill as a random pick): a turn that reaches the server its conversation's last turn did
    not fetches the history's state from the other (--prefix-cache-peers, which dsv4 up gives every
    prefill server), so every later turn resumes the turn before it wherever it lands. Turns that
    changed server are counted as the peer fetches the servers report."""
    from prometheus_util import scrape

    api, prefills = two_prefill_servers(tiny_model, spec_for, up, tmp_path, "cache_aware")

    def fetched() -> float:
        key = ("dsv4_prefix_cache_peer_fetches_total", (("outcome", "fetched"),))
        return sum(scrape(u).get(key, 0.0) for u in prefills)

    moved = 0
    for conv in ("a", "b", "c", "d"):
        history: list[dict[str, str]] = []
        last, cached = None, 0
        for turn in range(3):
            history.append(
                {"role": "user", "content": f"Conversation {conv}, turn {turn}: " + "tell me more. " * 40}
            )
            before, fetches = [prompt_tokens(u) for u in prefills], fetched()
            out = api.chat.completions.create(
                model="dsv4-tiny", messages=history, max_tokens=4, temperature=0
            )
            (server,) = [u for u, b in zip(prefills, before, strict=True) if prompt_tokens(u) > b]
            details = out.usage.prompt_tokens_details if out.usage else None
            now = details.cached_tokens if details else 0
            if turn:
                assert now > cached, (conv, turn, now, cached)  # resumed at least the turn before
                moved += server != last
                assert fetched() - fetches == (server != last), (conv, turn)
            last, cached = server, now
            history.append({"role": "assistant", "content": out.choices[0].message.content or ""})
    print(f"{moved} of 8 later turns reached the other prefill server")


def test_lm_eval_through_up(tiny_model: Path, spec_for: Any, up: Any, lm_eval: Any) -> None:
    """lm-eval's loglikelihood and generate_until tasks through the router in front of the PD pair:
    the prompt's logprobs, which only the prefill computes, come back through the decode and equal
    the engine's own. sglang-router 0.3.2 takes only text prompts on /v1/completions, so lm-eval runs
    with `tokenized_requests=False`; `add_bos_token=True` makes its own ids start with the BOS that
    the server keeps (it adds none to a text that already starts with one)."""
    from dsv4_engine.llm import LLM

    run = up(spec_for(tiny_model))
    base = run.endpoint().removesuffix("/v1")
    results, lm = lm_eval.run(
        base, "dsv4-tiny", tiny_model, batch_size=4, tokenized_requests=False, add_bos_token=True
    )
    with LLM(tiny_model) as llm:
        assert lm.tok_encode("x")[0] == llm.tokenizer.bos_token_id
        lm_eval.check(results, lm, llm)
