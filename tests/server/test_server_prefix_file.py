"""`dsv4 serve --prefix-cache-dir`: a server writes its prefix cache to a file of its own in the
directory (while it serves and when it drains) and the next server started on it resumes those prompts
from the cache, answering as the first did; a server of another memory layout names the difference in
its log and starts cold."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
from safetensors import safe_open

NAME = "dsv4-tiny"
SYSTEM = " ".join(f"rule{i} keep answers short and exact" for i in range(60))  # several pages


def _chat(base: str, question: str, system: str = SYSTEM) -> tuple[str, int]:
    body = {
        "model": NAME,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _args(checkpoint: Path, cache_dir: Path) -> tuple[str, ...]:
    return ("--model", str(checkpoint), "--served-model-name", NAME, "--prefix-cache-dir", str(cache_dir))


def _own_file(cache_dir: Path, port: int) -> Path:
    from dsv4_engine.server.prefix_file import file_name, owner_name

    return cache_dir / file_name(owner_name(port))


def _drain(server: Any) -> None:
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(120) == 0, server.log()[-4000:]


def _gauge(base: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", httpx.get(f"{base}/metrics", timeout=30).text, re.M)
    assert found is not None, name
    return float(found[1])


def test_a_restarted_server_resumes_from_the_saved_cache(
    tiny_checkpoint: Path, serve_process: Any, free_port_factory: Any, tmp_path: Path
) -> None:
    """The same server (its port) restarted: its own file is imported, the same answers come back
    resumed from it; a server of another layout refuses the file by name; a damaged one is passed
    over with a log line."""
    cache_dir, port = tmp_path / "prefixes", free_port_factory()
    args = _args(tiny_checkpoint, cache_dir)
    first = serve_process(*args, port=port)
    assert "starting cold" in first.log()
    _chat(first.base, "What is one plus one?")
    answer, cached = _chat(first.base, "Name a colour.")
    assert cached > 0  # the system prompt, from the first request
    _drain(first)
    path = _own_file(cache_dir, port)
    assert path.is_file() and [p.name for p in cache_dir.iterdir()] == [path.name]
    assert "prefix cache: saved" in first.log()

    # Fewer pages than the first server had: the records still fit, the fingerprint ignores pool sizes.
    second = serve_process(*args, "--num-pages", "96", port=port)
    imported = re.search(r"prefix cache: imported (\d+) of (\d+) prefixes from (\S+)", second.log())
    assert imported is not None and imported[1] == imported[2] != "0", second.log()[-2000:]
    assert imported[3] == str(path)
    assert _gauge(second.base, "dsv4_prefix_cache_imported_prefixes") == int(imported[1])
    again, resumed = _chat(second.base, "Name a colour.")
    assert again == answer
    assert resumed >= cached  # the saved cache holds this very prompt's last boundary too
    httpx.post(f"{second.base}/flush_cache", timeout=60).raise_for_status()
    _drain(second)

    # Another page size is another layout: the file is refused by name and the server starts cold.
    other = serve_process(*args, "--page-size", "256", port=port)
    assert "written by a server of another layout" in other.log()
    assert "page_size" in other.log()
    assert _gauge(other.base, "dsv4_prefix_cache_imported_prefixes") == 0
    assert _chat(other.base, "Name a colour.")[1] == 0
    other.stop()

    # A damaged file never stops a server from starting: it starts cold and says why.
    path.write_bytes(path.read_bytes()[:1000])
    # Under a size cap no prefix fits: the drain leaves the file as it was.
    damaged = serve_process(*args, "--prefix-cache-max-bytes", "1Ki", port=port)
    assert (
        f"prefix cache: {path.name}: " in damaged.log() and "(imported 0 prefixes before it)" in damaged.log()
    )
    assert _chat(damaged.base, "Name a colour.")[1] == 0
    _drain(damaged)
    assert "no prefix fits --prefix-cache-max-bytes" in damaged.log()
    assert path.stat().st_size == 1000


def test_a_server_saves_while_serving_so_a_crash_keeps_the_cache(
    tiny_checkpoint: Path, serve_process: Any, until: Any, free_port_factory: Any, tmp_path: Path
) -> None:
    """With a save interval the file is written while the server serves, not only at a drain: a server
    killed without draining (SIGKILL: an OOM kill, a lost node) leaves it, and the next server imports
    it and resumes the prompt from it."""
    cache_dir, port = tmp_path / "prefixes", free_port_factory()
    args = _args(tiny_checkpoint, cache_dir)
    first_started = time.time()
    first = serve_process(*args, "--prefix-cache-save-interval", "0.2", port=port)
    answer, _ = _chat(first.base, "Name a colour.")
    until(lambda: _gauge(first.base, "dsv4_prefix_cache_saved_prefixes") > 0, 120, "a save while serving")
    assert "prefix cache: saved" in first.log()
    assert _gauge(first.base, "dsv4_prefix_cache_last_save_timestamp_seconds") > first_started
    own = _own_file(cache_dir, port)
    touched = own.stat().st_mtime_ns
    # Unchanged, the file is touched every interval (so servers making room keep it) ...
    until(lambda: own.stat().st_mtime_ns > touched, 120, "the file touched at an interval")
    # ... and written again when it is gone, though the cache did not change.
    own.unlink()
    until(own.exists, 120, "the removed file written again")
    first.proc.kill()
    first.proc.wait(60)
    with safe_open(str(_own_file(cache_dir, port)), framework="pt") as f:
        saved = len(json.loads((f.metadata() or {})["records"]))  # the last save's, whichever it was

    second = serve_process(*args, "--prefix-cache-save-interval", "0", port=port)
    assert _gauge(second.base, "dsv4_prefix_cache_imported_prefixes") == saved > 0
    again, resumed = _chat(second.base, "Name a colour.")
    assert again == answer and resumed > 0
    httpx.post(f"{second.base}/flush_cache", timeout=60).raise_for_status()
    _chat(second.base, "Name a colour.")  # the cache changed since the import
    _drain(second)  # with the interval 0, the drain saves
    assert second.log().count("prefix cache: saved") == 1

    # Unchanged since the import: the drain leaves the file alone.
    third = serve_process(*args, "--prefix-cache-save-interval", "0", port=port)
    assert _gauge(third.base, "dsv4_prefix_cache_imported_prefixes") > 0
    _drain(third)
    assert "prefix cache: saved" not in third.log()


def test_servers_sharing_a_directory_keep_a_file_each(
    tiny_checkpoint: Path, serve_process: Any, tmp_path: Path
) -> None:
    """Two servers on one directory (prefill replicas on one claim) each write their own file; a new
    server imports both and resumes either one's prompts."""
    cache_dir = tmp_path / "prefixes"
    args = _args(tiny_checkpoint, cache_dir)
    a, b = serve_process(*args), serve_process(*args)
    other_system = " ".join(f"note{i} answer in full sentences" for i in range(60))
    want_a = _chat(a.base, "Name a colour.")[0]
    want_b = _chat(b.base, "Name a colour.", system=other_system)[0]
    _drain(a)
    _drain(b)
    files = sorted(cache_dir.glob("prefix-cache-*.safetensors"))
    assert len(files) == 2
    counts = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            counts.append(len(json.loads((f.metadata() or {})["records"])))

    c = serve_process(*args)
    assert _gauge(c.base, "dsv4_prefix_cache_imported_prefixes") == sum(counts)
    assert c.log().count("prefix cache: imported") == 2
    got_a, cached_a = _chat(c.base, "Name a colour.")
    got_b, cached_b = _chat(c.base, "Name a colour.", system=other_system)
    assert (got_a, got_b) == (want_a, want_b) and cached_a > 0 and cached_b > 0


def test_the_file_keeps_every_record_field(tmp_path: Path) -> None:
    """write then read: tokens, base, every state type's buffers (empty ones too) and the extra
    tensors (the MTP window) come back equal; another fingerprint is refused naming the field."""
    import pytest
    import torch

    from dsv4_engine.memory import StateType
    from dsv4_engine.memory.prefix_store import PrefixRecord
    from dsv4_engine.server import prefix_file

    def pages() -> dict[StateType, list[torch.Tensor]]:
        return {
            StateType.SWA: [torch.randn(2, 4, 8).to(torch.bfloat16), torch.randn(2, 4, 8)],
            StateType.C128_STATE: [torch.zeros(0, 4, 16)],
        }

    extra = {"mtp_from": torch.tensor(3), "mtp_rows": torch.randn(7, 8), "mtp_tail": torch.randn(2, 8)}
    records = [PrefixRecord((1, 2, 3, 4), 0, pages(), extra), PrefixRecord((1, 2, 3, 4, 5, 6), 4, pages())]
    path = tmp_path / prefix_file.file_name("host-30000")
    fingerprint = {"version": 1, "page_size": 4}
    file = prefix_file.contents(records, fingerprint)
    prefix_file.write(path, file)
    # The estimate a save makes room for holds the file, header included, and is not far over it.
    assert path.stat().st_size <= prefix_file.file_bytes(file) < 2 * path.stat().st_size
    back = prefix_file.read(path, fingerprint)
    assert [(r.tokens, r.base, sorted(r.extra)) for r in back] == [
        (r.tokens, r.base, sorted(r.extra)) for r in records
    ]
    for got, want in zip(back, records, strict=True):
        assert got.pages.keys() == want.pages.keys()
        for t in want.pages:
            for a, b in zip(got.pages[t], want.pages[t], strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)
        for k in want.extra:
            assert torch.equal(got.extra[k], want.extra[k])
    with pytest.raises(ValueError, match="page_size"):
        prefix_file.read(path, {"version": 1, "page_size": 8})


def test_a_file_is_named_after_its_pod_and_port() -> None:
    """POD_NAME (the operator's pods carry it; on the host network the hostname is the node's), else
    the hostname; then the port. Characters a file name should not hold become underscores."""
    import socket

    from dsv4_engine.server.prefix_file import file_name, owner_name

    assert owner_name(30000, {"POD_NAME": "dsv4-a-prefill-1"}) == "dsv4-a-prefill-1-30000"
    assert owner_name(30001, {}) == f"{socket.gethostname()}-30001"
    assert file_name("a/b c-1") == "prefix-cache-a_b_c-1.safetensors"


def test_a_full_volume_loses_the_files_of_servers_gone_oldest_first(tmp_path: Path) -> None:
    """make_room removes other servers' files older than the live mark, oldest first, and a killed
    writer's temporary file, until the bytes asked for are free; never this server's own file, nor a
    file a running server touched since the mark; none when there is room already."""
    import os

    from dsv4_engine.server.prefix_file import make_room

    capacity = 100

    def free(d: Path) -> int:
        return capacity - sum(p.stat().st_size for p in d.iterdir())

    def put(name: str, size: int, mtime: float) -> Path:
        path = tmp_path / name
        path.write_bytes(b"x" * size)
        os.utime(path, (mtime, mtime))
        return path

    own = put("prefix-cache-me-1.safetensors", 20, 10.0)  # the oldest of all: still kept
    gone_old = put("prefix-cache-a-1.safetensors", 20, 20.0)
    tmp = put(".prefix-cache-b-1.safetensors.77.tmp", 10, 30.0)
    gone_new = put("prefix-cache-c-1.safetensors", 20, 40.0)
    live = put("prefix-cache-d-1.safetensors", 20, 1000.0)
    assert free(tmp_path) == 10

    assert make_room(tmp_path, own, 10, live_since=500.0, free=free) == []
    assert make_room(tmp_path, own, 35, live_since=500.0, free=free) == [gone_old, tmp]
    assert free(tmp_path) == 40 and gone_new.exists()
    # More than the files of servers gone hold: they all go, the live one and this one's stay.
    assert make_room(tmp_path, own, 90, live_since=500.0, free=free) == [gone_new]
    assert sorted(tmp_path.iterdir()) == sorted([own, live])
