"""`dsv4 serve --prefix-cache-peers`: a server that lacks a prompt's prefix fetches it from a peer whose
cache holds it and answers as if it had prefilled it; a peer that stalls, fails or differs in layout
costs at most the timeout, and the routes peers call refuse bad input by name."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4_engine.server.prefix_file import unpack
from dsv4_engine.server.prefix_peers import PrefixPeers

NAME = "dsv4-tiny"
SYSTEM = " ".join(f"rule{i} keep answers short and exact" for i in range(60))  # several pages


def _chat(base: str, messages: list[dict[str, str]]) -> tuple[str, int]:
    body = {"model": NAME, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _metric(base: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{base}/metrics", timeout=30).text, re.M)
    assert found is not None, name
    return float(found[1])


def _fetches(base: str, outcome: str) -> float:
    return _metric(base, f'dsv4_prefix_cache_peer_fetches_total{{outcome="{outcome}"}}')


def test_a_conversation_continues_on_a_server_that_never_saw_it(
    tiny_checkpoint: Path, serve_process: Any, free_port_factory: Any
) -> None:
    """Two servers given the same peer list (each leaves itself out): a chat's first turn on one, its
    second on the other, which fetches the history's state from the first and resumes from it; the
    answer equals the first server's for the same turn prefilled from nothing."""
    pa, pb = free_port_factory(), free_port_factory()
    peers = f"http://127.0.0.1:{pa},http://127.0.0.1:{pb}"
    args = ("--model", str(tiny_checkpoint), "--served-model-name", NAME, "--prefix-cache-peers", peers)
    a, b = serve_process(*args, port=pa), serve_process(*args, port=pb)

    turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    first, cached = _chat(a.base, turn)
    assert cached == 0 and _fetches(a.base, "none") == 1  # b had nothing either
    turn += [{"role": "assistant", "content": first}, {"role": "user", "content": "And another?"}]
    second, cached = _chat(b.base, turn)
    assert cached > 0, b.log()[-3000:]
    assert _fetches(b.base, "fetched") == 1 and _fetches(b.base, "failed") == 0
    assert _metric(b.base, "dsv4_prefix_cache_peer_fetched_tokens_total") == cached  # b had nothing
    assert _metric(a.base, "dsv4_prefix_cache_peer_exports_total") == 1
    assert f"from http://127.0.0.1:{pa}" in b.log()

    for server in (a, b):  # else a fetches the turn back from b
        assert httpx.post(f"{server.base}/flush_cache", timeout=60).status_code == 200
    want, cached = _chat(a.base, turn)
    assert cached == 0 and second == want


def _stalled() -> socket.socket:
    """A listening socket that never accepts: a connection opens (the backlog) and no answer comes."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


def test_a_stalled_peer_costs_a_request_at_most_the_timeout(settings_factory: Any, serve: Any) -> None:
    """A peer that never answers: the request waits for it at most --prefix-cache-peer-timeout, then
    prefills here and answers; the failure is counted."""
    from dsv4_engine.server.app import create_app

    with _stalled() as stall:
        url = f"http://127.0.0.1:{stall.getsockname()[1]}"
        settings = settings_factory(prefix_cache_peers=[url], prefix_cache_peer_timeout=0.5)
        with serve(create_app(settings)) as base:
            turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
            _, cached = _chat(base, turn)
            assert cached == 0
            assert _fetches(base, "failed") == 1 and _fetches(base, "fetched") == 0


def test_the_peer_routes_answer_what_was_cached_and_refuse_bad_input(
    settings_factory: Any, serve: Any
) -> None:
    """lookup says how far the cache resumes a prompt; fetch gives the record of it from a page-aligned
    base (204 at or past it), and refuses an unaligned base (400), a body of the wrong shape (400) and
    a server of another layout (409, naming the field)."""
    from dsv4_engine.testing import random_ids

    with serve(create_app_for(settings_factory)) as base:
        info = httpx.get(f"{base}/server_info", timeout=30).json()
        fingerprint = info["layout_fingerprint"]
        assert fingerprint is not None  # computed once peers were set up
        page = fingerprint["page_size"]
        ids = random_ids(5 * page + 7, seed=3)
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        assert httpx.post(f"{base}/generate", json=body, timeout=300).status_code == 200

        length = httpx.post(f"{base}/prefix_cache/lookup", json={"input_ids": ids}, timeout=30).json()[
            "length"
        ]
        assert length > 0 and length % page == 0 and length <= len(ids)
        r = httpx.post(
            f"{base}/prefix_cache/fetch",
            json={"input_ids": ids, "base": page, "fingerprint": fingerprint},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        (record,) = unpack(r.content, fingerprint)
        assert record.tokens == tuple(ids[:length]) and record.base == page
        other = {**fingerprint, "page_size": page * 2}
        with pytest.raises(ValueError, match="page_size"):  # the asking side checks the layout too
            unpack(r.content, other)
        with pytest.raises(ValueError, match="not prefix-cache records"):
            unpack(r.content[:100], fingerprint)
        at_end = {"input_ids": ids, "base": length, "fingerprint": fingerprint}
        assert httpx.post(f"{base}/prefix_cache/fetch", json=at_end, timeout=60).status_code == 204

        bad = {"input_ids": ids, "base": 3, "fingerprint": fingerprint}
        r = httpx.post(f"{base}/prefix_cache/fetch", json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "base"
        r = httpx.post(f"{base}/prefix_cache/lookup", json={"input_ids": "abc"}, timeout=30)
        assert r.status_code == 400 and "input_ids" in r.text
        r = httpx.post(
            f"{base}/prefix_cache/fetch", json={"input_ids": ids, "base": 0, "fingerprint": other}, timeout=30
        )
        assert r.status_code == 409 and "page_size" in r.json()["error"]["message"]


def create_app_for(settings_factory: Any) -> Any:
    """A server with peers configured (a closed port: its lookups fail), so its fingerprint is set."""
    from dsv4_engine.server.app import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    return create_app(settings_factory(prefix_cache_peers=[f"http://127.0.0.1:{closed}"]))


async def test_a_server_leaves_itself_out_of_its_peers(settings_factory: Any) -> None:
    """Every server of a role gets the same list: its own address and port is not a peer, another port
    on the same address is, and a name resolving to this machine counts as this machine."""
    from dsv4_engine.server.state import ServerContext

    ctx = ServerContext(settings_factory(port=31000))
    urls = [
        "http://127.0.0.1:31000",
        "http://127.0.0.1:31001",
        "http://localhost:31000",
        "http://10.255.255.1:31000",
    ]
    peers = PrefixPeers(ctx, urls, timeout=1.0)
    got = await peers.peers()
    assert "http://127.0.0.1:31001" in got and "http://10.255.255.1:31000" in got
    assert "http://127.0.0.1:31000" not in got and all(not u.endswith(":31000") or "10.255" in u for u in got)


def test_the_flags_refuse_what_cannot_work(capsys: pytest.CaptureFixture[str]) -> None:
    """A peer list needs the cache, and base URLs of plain-HTTP servers; each refusal names why."""
    from dsv4_engine.server.args import parse

    got = parse(["--model", "m", "--prefix-cache-peers", "http://a:1, http://b:2/"])
    assert got.prefix_cache_peers == ["http://a:1", "http://b:2"] and got.prefix_cache_peer_timeout == 2.0
    for argv, why in (
        (["--prefix-cache-peers", "http://a:1", "--disable-radix-cache"], "needs the prefix cache"),
        (["--prefix-cache-peers", "https://a:1"], "expected base URLs"),
        (["--prefix-cache-peers", "http://a:1/v1"], "expected base URLs"),
    ):
        with pytest.raises(SystemExit):
            parse(["--model", "m", *argv])
        assert why in capsys.readouterr().err
