"""Wait for a dsv4 server to be ready, then talk to it with the official openai client."""

from __future__ import annotations

import argparse
import os
import sys
import time

import httpx
from openai import OpenAI


def wait_ready(base_url: str, server_pid: int | None, timeout: float) -> None:
    health = base_url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server_pid is not None:
            try:
                os.kill(server_pid, 0)
            except ProcessLookupError:
                sys.exit("demo: the server exited before it became ready")
        try:
            if httpx.get(health, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling a readiness probe, not synchronising on time
    sys.exit(f"demo: {health} not ready after {timeout:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--server-pid", type=int)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()

    wait_ready(args.base_url, args.server_pid, args.timeout)
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("DSV4_API_KEY", "none"))
    print("models:", [m.id for m in client.models.list().data])

    messages = [{"role": "user", "content": "Say hello to the cluster."}]
    reply = client.chat.completions.create(model=args.model, messages=messages, max_tokens=24, temperature=0)
    print("chat:", repr(reply.choices[0].message.content), "| finish:", reply.choices[0].finish_reason)
    print("usage:", reply.usage.model_dump())

    print("stream: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    # A random model ends early when it happens to sample EOS; ignore_eos (an SGLang/vLLM extension
    # the server honours) shows a full-length completion.
    text = client.completions.create(
        model=args.model, prompt="The cluster", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    print("completion:", repr(text.choices[0].text), "| tokens:", text.usage.completion_tokens)
    print("(a random tiny model: the words are noise; the serving path is real)")


if __name__ == "__main__":
    main()
