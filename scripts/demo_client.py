"""Talk to a dsv4 endpoint with the official openai client, once it is ready.

    demo_client.py --up-output FILE --pid PID    # the endpoint `dsv4 up` prints into FILE (its output)
    demo_client.py --base-url URL [--pid PID]    # a router or server at URL, ready when /health says so

--pid names the process whose exit means the endpoint will never come (dsv4 up, or a server).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from openai import OpenAI

ENDPOINT = re.compile(r"^dsv4 up: endpoint (\S+)", re.MULTILINE)  # the line dsv4 up prints when ready
POLL_SECONDS = 0.2  # polling a readiness signal, not synchronising on time


def gone(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_for(probe: Callable[[], str | None], what: str, pid: int | None, timeout: float) -> str:
    """Poll `probe()` until it returns a value; give up when `pid` exits or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        if gone(pid):
            sys.exit(f"demo: process {pid} exited before {what}")
        time.sleep(POLL_SECONDS)
    sys.exit(f"demo: no {what} after {timeout:.0f}s")


def endpoint_in(output: Path) -> str | None:
    try:
        match = ENDPOINT.search(output.read_text(errors="replace"))
    except OSError:
        return None
    return match.group(1) if match else None


def healthy(base_url: str) -> str | None:
    try:
        ok = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return None
    return base_url if ok else None


def converse(base_url: str, model: str) -> None:
    client = OpenAI(base_url=base_url, api_key=os.environ.get("DSV4_API_KEY", "none"))
    print("models:", [m.id for m in client.models.list().data])

    # The bundled demo model learned Python's help topics: ask it about one (greedy, so every run and
    # every path, colocated or PD, writes the same words).
    messages = [{"role": "user", "content": 'What is the "try" statement?'}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0)
    print("chat:", repr(reply.choices[0].message.content), "| finish:", reply.choices[0].finish_reason)
    print("usage:", reply.usage.model_dump())

    print("stream: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=64, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    text = client.completions.create(
        model=model, prompt='The "while" statement is used', max_tokens=32, temperature=0
    )
    print("completion:", repr(text.choices[0].text), "| tokens:", text.usage.completion_tokens)


def main() -> None:
    parser = argparse.ArgumentParser()
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="an OpenAI base URL (.../v1)")
    where.add_argument("--up-output", type=Path, help="a file receiving dsv4 up's output")
    parser.add_argument("--model", required=True)
    parser.add_argument("--pid", type=int, help="give up when this process exits")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()

    if args.up_output is not None:
        base_url = wait_for(lambda: endpoint_in(args.up_output), "dsv4 up's endpoint", args.pid, args.timeout)
    else:
        base_url = wait_for(
            lambda: healthy(args.base_url), f"{args.base_url} healthy", args.pid, args.timeout
        )
    print("endpoint:", base_url)
    converse(base_url, args.model)


if __name__ == "__main__":
    main()
