"""`dsv4 serve --prefix-cache-dir`: a draining server writes its prefix cache to the directory and the
next server started on it resumes those prompts from the cache, answering as the first did; a server
of another memory layout names the difference in its log and starts cold."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import httpx

NAME = "dsv4-tiny"
SYSTEM = " ".join(f"rule{i} keep answers short and exact" for i in range(60))  # several pages


def _chat(base: str, question: str) -> tuple[str, int]:
    body = {
        "model": NAME,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _drain(server: Any) -> None:
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(120) == 0, server.log()[-4000:]


def test_a_restarted_server_resumes_from_the_saved_cache(
    tiny_checkpoint: Path, serve_process: Any, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "prefixes"
    args = (
        "--model",
        str(tiny_checkpoint),
        "--served-model-name",
        NAME,
        "--prefix-cache-dir",
        str(cache_dir),
    )
    first = serve_process(*args)
    assert "no prefix-cache.safetensors yet" in first.log() or "starting cold" in first.log()
    _chat(first.base, "What is one plus one?")
    answer, cached = _chat(first.base, "Name a colour.")
    assert cached > 0  # the system prompt, from the first request
    _drain(first)
    assert (cache_dir / "prefix-cache.safetensors").is_file()
    assert "prefix cache: saved" in first.log()

    # Fewer pages than the first server had: the records still fit, the fingerprint ignores pool sizes.
    second = serve_process(*args, "--num-pages", "96")
    imported = re.search(r"prefix cache: imported (\d+) of (\d+) prefixes", second.log())
    assert imported is not None and imported[1] == imported[2] != "0", second.log()[-2000:]
    again, resumed = _chat(second.base, "Name a colour.")
    assert again == answer
    assert resumed >= cached  # the saved cache holds this very prompt's last boundary too
    httpx.post(f"{second.base}/flush_cache", timeout=60).raise_for_status()
    _drain(second)

    # Another page size is another layout: the file is refused by name and the server starts cold.
    other = serve_process(*args, "--page-size", "256")
    assert "written by a server of another layout" in other.log()
    assert "page_size" in other.log()
    assert _chat(other.base, "Name a colour.")[1] == 0
    other.stop()

    # A damaged file never stops a server from starting: it starts cold and says why.
    path = cache_dir / "prefix-cache.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    damaged = serve_process(*args)
    assert "prefix cache: not loaded, starting cold" in damaged.log()
    assert _chat(damaged.base, "Name a colour.")[1] == 0
