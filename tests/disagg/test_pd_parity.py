"""A prompt prefilled by one `dsv4 serve`, its state moved over Mooncake (TCP), decoded by another:
the output is exactly a colocated server's (and HF's), and decode really used the transferred state.

Prefill servers chunk at 128, 256 and not at all (2048 > every prompt); prompt lengths cross the
window (16 on the tiny preset), the ratio-4 and ratio-128 boundaries and are mostly not multiples of
them. Decode servers poison their reserved pages with NaN before each transfer (test hooks), so a
page the transfer missed cannot go unnoticed. Requests go in concurrently, so rooms interleave.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import statistics
import time
from typing import Any

import httpx
import pytest
from openai import OpenAI

from dsv4_engine.testing import random_ids

LENGTHS = [1, 15, 16, 17, 125, 128, 130, 256, 383, 515, 1030, 1499]
CHUNKS = (128, 256, 2048)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(spawn: Any, pd: Any) -> dict[str, Any]:
    # P2048's writes wait 30 s (the others' 5 s, conftest): the stalled-peer test holds one open.
    servers = {f"P{c}": spawn(f"P{c}", "--disaggregation-mode", "prefill", "--chunked-prefill-size", str(c),
                              env={"MC_TRANSFER_TIMEOUT": "30"} if c == 2048 else None)
               for c in CHUNKS}  # fmt: skip
    servers["D1"] = spawn("D1", "--disaggregation-mode", "decode")
    servers["D2"] = spawn("D2", "--disaggregation-mode", "decode")
    servers["C"] = spawn("C")
    pd.wait_healthy(*servers.values())
    servers["initial"] = {name: s.free_pages() for name, s in servers.items()}
    return servers


def client(server: Any) -> OpenAI:
    return OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=300)


def pd_completion(prefill: Any, decode: Any, prompt: list[int], pd: Any, **params: Any) -> tuple[Any, Any]:
    """Both legs through the official openai client, the bootstrap fields in extra_body."""
    extra = {**pd.pd_body(prefill, {}), "ignore_eos": True}
    kw = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "extra_body": extra, **params}
    with cf.ThreadPoolExecutor(2) as ex:
        p = ex.submit(client(prefill).completions.create, **kw)
        d = ex.submit(client(decode).completions.create, **kw)
        return p.result(), d.result()


def colocated(server: Any, prompt: list[int], pd: Any, **params: Any) -> list[int]:
    return pd.generate(server, prompt, MAX_TOKENS, **params)


def pd_generate(prefill: Any, decode: Any, prompt: list[int], pd: Any, **params: Any) -> list[int]:
    return pd.pd_generate(prefill, decode, prompt, MAX_TOKENS, **params)


@pytest.fixture(scope="module")
def references(cluster: dict[str, Any], pd: Any) -> dict[int, list[int]]:
    greedy = {"temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(4) as ex:
        outs = ex.map(lambda n: colocated(cluster["C"], random_ids(n, seed=n), pd, **greedy), LENGTHS)
        return dict(zip(LENGTHS, outs, strict=True))


@pytest.mark.parametrize("chunk", CHUNKS)
def test_greedy_pd_equals_colocated(
    cluster: dict[str, Any], references: dict[int, list[int]], pd: Any, chunk: int
) -> None:
    prefill, decode = cluster[f"P{chunk}"], cluster["D1" if chunk != 256 else "D2"]
    forwarded = decode.engine()["forwarded_tokens_total"]
    generated = cluster[f"P{chunk}"].engine()["generation_tokens_total"]
    greedy = {"temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(4) as ex:
        outs = list(
            ex.map(lambda n: pd_generate(prefill, decode, random_ids(n, seed=n), pd, **greedy), LENGTHS)
        )
    for n, out in zip(LENGTHS, outs, strict=True):
        assert out == references[n], f"prompt of {n} tokens, prefill chunk {chunk}"
    # Decode ran one token per output token after the first, never the prompt; the prefill sampled
    # exactly one token per request (no preemption at this load: pools are large).
    assert decode.engine()["num_preemptions"] == 0
    assert decode.engine()["forwarded_tokens_total"] - forwarded == len(LENGTHS) * (MAX_TOKENS - 1)
    assert prefill.engine()["generation_tokens_total"] - generated == len(LENGTHS)
    pd.settle(prefill, decode, initial=cluster["initial"])


# Across the ratio-4 (3-5), window (16-17 on the tiny preset) and ratio-128 / page (127-129)
# boundaries, to the longest prompt; each prefill chunking in turn.
HF_LENGTHS = [1, 3, 4, 5, 16, 17, 127, 128, 129, 515, 1499]


def test_pd_matches_hf(cluster: dict[str, Any], pd: Any, tiny_model: Any) -> None:
    from dsv4_engine.testing import greedy_divergences, load_hf

    hf = load_hf(tiny_model)
    for i, n in enumerate(HF_LENGTHS):
        prompt = random_ids(n, seed=n)
        prefill = cluster[f"P{CHUNKS[i % len(CHUNKS)]}"]
        out = pd_generate(prefill, cluster["D1"], prompt, pd, temperature=0, ignore_eos=True)
        assert len(greedy_divergences(hf, prompt, out)) <= 1, n  # the parity rule: only excused ones


def test_openai_client_streaming_and_not(
    cluster: dict[str, Any], references: dict[int, list[int]], pd: Any, tiny_model: Any
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    for n in (130, 515):
        prompt = random_ids(n, seed=n)
        want = tokenizer.decode(references[n], skip_special_tokens=True)
        p, d = pd_completion(cluster["P256"], cluster["D1"], prompt, pd, temperature=0)
        assert d.choices[0].text == want and d.usage.completion_tokens == MAX_TOKENS
        assert p.usage.completion_tokens == 1
        p, d = pd_completion(cluster["P128"], cluster["D2"], prompt, pd, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in d if c.choices) == want
        assert "".join(c.choices[0].text for c in p if c.choices) == tokenizer.decode(references[n][:1])


def test_seeded_sampling_equals_colocated(cluster: dict[str, Any], pd: Any) -> None:
    sampling = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "sampling_seed": 1234, "ignore_eos": True}
    for n in (17, 300):
        prompt = random_ids(n, seed=n + 1)
        want = colocated(cluster["C"], prompt, pd, **sampling)
        assert pd_generate(cluster["P128"], cluster["D1"], prompt, pd, **sampling) == want
        assert pd_generate(cluster["P2048"], cluster["D2"], prompt, pd, **sampling) == want
    assert (
        len(set(map(tuple, [want, colocated(cluster["C"], prompt, pd, **{**sampling, "sampling_seed": 1})])))
        == 2
    )


def test_penalties_bias_min_p_and_min_tokens_equal_colocated(cluster: dict[str, Any], pd: Any) -> None:
    """Both legs apply the same settings: the prefill to the first token (the prompt its history),
    the decode to the rest (prompt and first token): the output is the colocated server's."""
    plain = {"temperature": 0.9, "top_k": 50, "sampling_seed": 99}
    sampling = {
        **plain, "presence_penalty": 1.2, "frequency_penalty": 0.6, "repetition_penalty": 1.4,
        "min_p": 0.05, "logit_bias": {"40": 6.0}, "min_new_tokens": 5,
    }  # fmt: skip
    prompt = random_ids(140, seed=41)
    want = colocated(cluster["C"], prompt, pd, **sampling)
    assert len(want) >= 5 and want != colocated(cluster["C"], prompt, pd, **plain)
    assert pd_generate(cluster["P128"], cluster["D1"], prompt, pd, **sampling) == want
    pd.settle(cluster["P128"], cluster["D1"], initial=cluster["initial"])


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "n": 2}, "n"),  # one room for two choices
        ("/generate", {"text": "x", "sampling_params": {"n": 2}}, "n"),
    ],
)
def test_what_does_not_travel_is_refused_by_both_legs(
    cluster: dict[str, Any], pd: Any, route: str, body: dict[str, Any], param: str
) -> None:
    p, d = pd.send_pair(cluster["P128"], cluster["D2"], pd.pd_body(cluster["P128"], body), route)
    for r, mode in ((p, "prefill"), (d, "decode")):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (param, "unsupported_parameter") and mode in err["message"]


def test_two_prefill_two_decode_interleaved(
    cluster: dict[str, Any], references: dict[int, list[int]], pd: Any
) -> None:
    pairs = [(p, d) for p in ("P128", "P256") for d in ("D1", "D2")]
    jobs = [(pairs[i % 4], n) for i, n in enumerate(random.Random(7).sample(LENGTHS, 8))]
    greedy = {"temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(8) as ex:
        futures = {
            ex.submit(pd_generate, cluster[p], cluster[d], random_ids(n, seed=n), pd, **greedy): n
            for (p, d), n in jobs
        }
        for future, n in futures.items():
            assert future.result() == references[n]
    pd.settle(*(cluster[k] for k in ("P128", "P256", "D1", "D2")), initial=cluster["initial"])


def test_prefix_cache_hit_through_pd(cluster: dict[str, Any], pd: Any, tiny_model: Any) -> None:
    """The prefill server resumes the second prompt from its prefix cache (the first left a snapshot at
    its last page boundary, 512); the transfer still moves the request's whole state, so the decode's
    output is the colocated server's, and both legs report the hit in usage."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    base = random_ids(600, seed=501)
    prompts = [base + random_ids(30, seed=502), base + random_ids(45, seed=503)]
    prefill, decode = cluster["P128"], cluster["D1"]
    hits = prefill.engine()["prefix_cache_hits"]
    for prompt, cached in zip(prompts, (0, 512), strict=True):
        want = tokenizer.decode(colocated(cluster["C"], prompt, pd, temperature=0, ignore_eos=True))
        p, d = pd_completion(prefill, decode, prompt, pd, temperature=0)
        assert d.choices[0].text == want
        assert p.usage.prompt_tokens_details.cached_tokens == cached
        assert d.usage.prompt_tokens_details.cached_tokens == cached
    assert prefill.engine()["prefix_cache_hits"] - hits == 512
    pd.settle(prefill, decode, initial=cluster["initial"])


def _room_digests(server: Any, room: int) -> dict[str, str]:
    return server.get("/debug/pd")["checksums"][str(room)]


def test_decode_pages_hold_the_prefill_bytes(cluster: dict[str, Any], pd: Any) -> None:
    body = pd.pd_body(
        cluster["P256"], {"input_ids": random_ids(700, seed=3), "sampling_params": {"max_new_tokens": 2}}
    )
    p, d = pd.send_pair(cluster["P256"], cluster["D2"], body, "/generate")
    assert p.status_code == d.status_code == 200
    sent, received = (
        _room_digests(cluster["P256"], body["bootstrap_room"]),
        _room_digests(cluster["D2"], body["bootstrap_room"]),
    )
    assert set(sent) == {"SWA", "C4", "C128", "INDEXER", "C4_STATE", "C128_STATE"}
    assert sent == received


def _writes(server: Any, path: str) -> float:
    line = f'dsv4_pd_transfer_writes_total{{path="{path}"}}'
    found = [x for x in httpx.get(f"{server.base}/metrics").text.splitlines() if x.startswith(line)]
    return float(found[0].split()[-1]) if found else 0.0


# Every write path but direct, forced on the prefill (the model picks direct for these fresh pools).
# A pipelined path's jobs of a single page go unpipelined: both labels count for it.
FORCED = {
    "staged": ("staged",),
    "staged_pipelined": ("staged_pipelined", "staged"),
    "pack_only": ("pack_only",),
    "pack_only_pipelined": ("pack_only_pipelined", "pack_only"),
    "unpack_only": ("unpack_only",),
}


@pytest.mark.parametrize("mode", list(FORCED))
def test_staged_transfers_equal_direct_ones(
    cluster: dict[str, Any], references: dict[int, list[int]], pd: Any, mode: str
) -> None:
    """Every job on one path (packed on the prefill, unpacked on the decode, or only one of them,
    pipelined or not): the same output, the same bytes. The staged path runs every prompt length,
    the others a sample of them that crosses the same boundaries."""
    prefill, decode = cluster["P256"], cluster["D1"]
    lengths = LENGTHS if mode == "staged" else [1, 17, 130, 515, 1499]
    prefill.post("/debug/pd/staging", params={"mode": mode}).raise_for_status()
    labels = FORCED[mode]
    try:
        before, direct = [_writes(prefill, x) for x in labels], _writes(prefill, "direct")
        greedy = {"temperature": 0, "ignore_eos": True}
        with cf.ThreadPoolExecutor(4) as ex:
            outs = list(
                ex.map(lambda n: pd_generate(prefill, decode, random_ids(n, seed=n), pd, **greedy), lengths)
            )
        for n, out in zip(lengths, outs, strict=True):
            assert out == references[n], f"prompt of {n} tokens, {mode}"
        after = [_writes(prefill, x) for x in labels]
        assert after[0] > before[0]  # the path itself was taken...
        assert sum(after) - sum(before) >= len(lengths)  # ...by at least the last job of each
        assert _writes(prefill, "direct") == direct
        body = pd.pd_body(
            prefill, {"input_ids": random_ids(700, seed=4), "sampling_params": {"max_new_tokens": 2}}
        )
        p, d = pd.send_pair(prefill, decode, body, "/generate")
        assert p.status_code == d.status_code == 200
        assert _room_digests(prefill, body["bootstrap_room"]) == _room_digests(decode, body["bootstrap_room"])
    finally:
        prefill.post("/debug/pd/staging", params={"mode": "auto"}).raise_for_status()
    pd.settle(prefill, decode, initial=cluster["initial"])  # staging spans back too (a PD depth)


def test_a_corrupted_source_page_changes_the_first_decode_step(cluster: dict[str, Any], pd: Any) -> None:
    prompt = {
        "input_ids": random_ids(300, seed=5),
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    }

    def first_step_logits(room: int) -> str:
        logits = cluster["D1"].get("/debug/pd")["logits"]
        (key,) = [k for k in logits if k.startswith(f"pd-{room}-")]
        return logits[key]

    rooms = []
    for corrupt in (False, False, True):
        if corrupt:
            cluster["P128"].post("/debug/pd/corrupt", params={"state_type": "SWA"}).raise_for_status()
        body = pd.pd_body(cluster["P128"], prompt)
        p, d = pd.send_pair(cluster["P128"], cluster["D1"], body, "/generate")
        assert p.status_code == d.status_code == 200
        rooms.append(body["bootstrap_room"])
    clean, again, corrupted = (first_step_logits(r) for r in rooms)
    assert clean == again  # the digest is deterministic...
    assert corrupted != clean  # ...and it moves with the transferred bytes: decode read them


# Pages of each state type a 300-token prompt has on the tiny preset (window 16, pages of 128), as
# tests/memory/test_mem_pd.py::test_payloads_hand_checked works them out: the SWA window's page,
# compressed rows [0, 75) and [0, 2), and one page of each state tail.
PAGES_300 = {"SWA": 1, "C4": 3, "INDEXER": 3, "C128": 2, "C4_STATE": 1, "C128_STATE": 1}


def _series(server: Any) -> dict[str, float]:
    """Every dsv4_pd_* sample of the server's /metrics, by its name and labels."""
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    return {
        k: float(v) for k, _, v in (x.rpartition(" ") for x in text.splitlines() if x.startswith("dsv4_pd_"))
    }


def test_every_pd_series_moves_by_what_one_request_moved(cluster: dict[str, Any], pd: Any) -> None:
    """One 300-token request through P2048 (one chunk: one write) and D2: the bytes per state type
    each side counts are its pages times their size (the layout fingerprint's item lengths), the
    transfer histogram counts one on each side, the decode's queue gauge shows it while it waits,
    the handshake counts a first pairing only, the writes counter one write; and both servers log
    the router's request id."""
    P, D = cluster["P2048"], cluster["D2"]
    items = httpx.get(f"{P.base}/server_info", timeout=10).json()["layout_fingerprint"]["item_lens"]
    paired = f"127.0.0.1:{P.bootstrap_port}" in D.get("/debug/pd")["paired"]
    before = {x.name: _series(x) for x in (P, D)}
    body = pd.pd_body(P, {"input_ids": random_ids(300, seed=77), "sampling_params": {"max_new_tokens": 3}})
    P.pause()
    with cf.ThreadPoolExecutor(1) as ex:
        try:
            future = ex.submit(pd.send_pair, P, D, body, "/generate", headers={"x-request-id": "pd-trace-42"})
            pd.wait_until(lambda: D.get("/debug/pd")["depths"]["transfer"] == 1, 60, "the decode to wait")
            assert _series(D)['dsv4_pd_queue_depth{queue="transfer"}'] == 1
        finally:
            P.resume()
        p, d = future.result(timeout=300)
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    after = {x.name: _series(x) for x in (P, D)}

    def delta(server: Any, key: str) -> float:
        return after[server.name].get(key, 0.0) - before[server.name].get(key, 0.0)

    for t, pages in PAGES_300.items():
        for server in (P, D):
            assert delta(server, f'dsv4_pd_transfer_bytes_total{{state_type="{t}"}}') == pages * sum(
                items[t]
            ), t
    for server in (P, D):
        assert delta(server, "dsv4_pd_transfer_seconds_count") == 1
        assert after[server.name]['dsv4_pd_queue_depth{queue="transfer"}'] == 0
    assert delta(D, "dsv4_pd_handshake_seconds_count") == (0 if paired else 1)
    writes = [k for k in after[P.name] if k.startswith("dsv4_pd_transfer_writes_total{")]
    assert sum(delta(P, k) for k in writes) == 1
    for server in (P, D):
        assert "x-request-id=pd-trace-42" in server.log()
    assert '"layout_fingerprint_id"' in httpx.get(f"{D.base}/server_info").text


def test_max_tokens_one_and_a_first_token_that_is_eos_end_at_the_prefills_token(
    cluster: dict[str, Any], pd: Any, tiny_model: Any
) -> None:
    """The decode admits the request with the prefill's token and runs no step for it: max_tokens 1
    ends there ("length"), and so does a first token that is EOS ("stop", here made so by a
    logit_bias both legs apply); each as a colocated server answers."""
    import json

    config = json.loads((tiny_model / "config.json").read_text())
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], int) else config["eos_token_id"][0]
    prompt = random_ids(200, seed=88)
    D = cluster["D2"]
    for params in (
        {"max_new_tokens": 1, "temperature": 0},
        {"max_new_tokens": 8, "logit_bias": {str(eos): 100.0}},
    ):
        body = {"input_ids": prompt, "sampling_params": params}
        want = cluster["C"].post("/generate", json=body).json()
        forwarded = D.engine()["forwarded_tokens_total"]
        p, d = pd.send_pair(cluster["P256"], D, pd.pd_body(cluster["P256"], body), "/generate")
        assert p.status_code == d.status_code == 200, (p.text, d.text)
        got = d.json()
        assert got["output_ids"] == want["output_ids"] and len(got["output_ids"]) <= 1, params
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], params
        assert D.engine()["forwarded_tokens_total"] == forwarded  # the decode ran nothing for it
    assert want["meta_info"]["finish_reason"]["type"] == "stop"
    pd.settle(cluster["P256"], D, initial=cluster["initial"])


def _ttft(prefill: Any, decode: Any, pd: Any, seed: int) -> float:
    """Seconds until a one-token request through the pair has answered on both legs: its TTFT."""
    body = pd.pd_body(prefill, {"model": "tiny", "prompt": random_ids(64, seed=seed), "max_tokens": 1})
    start = time.perf_counter()
    p, d = pd.send_pair(prefill, decode, body)
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    return time.perf_counter() - start


def test_a_stalled_decode_server_leaves_another_decodes_ttft_alone(cluster: dict[str, Any], pd: Any) -> None:
    """SGLang #5450: one transfer thread per prefill made every room wait behind a stalled peer.
    P2048 writes to D1 with one entry held in flight (the hook of a stalled peer, held until released)
    while a request to D2 is timed; interleaved with the same request timed without the stall. The
    median TTFT with the stall is at most 1.5x the median without (the tolerance covers two shared
    cores; a serialised writer waits the held entry's 30 s deadline instead)."""
    P, stalled, healthy = cluster["P2048"], cluster["D1"], cluster["D2"]
    _ttft(P, healthy, pd, 500)  # paired and warm before timing
    times: dict[bool, list[float]] = {True: [], False: []}
    with cf.ThreadPoolExecutor(1) as ex:
        for i in range(6):
            for stall in (i % 2 == 0, i % 2 == 1):
                if not stall:
                    times[False].append(_ttft(P, healthy, pd, 510 + i))
                    continue
                body = pd.pd_body(
                    P, {"model": "tiny", "prompt": random_ids(64, seed=520 + i), "max_tokens": 1}
                )
                room = body["bootstrap_room"]
                P.post("/debug/pd/hold", params={"room": room}).raise_for_status()
                held = ex.submit(pd.send_pair, P, stalled, body)
                try:
                    pd.wait_until(
                        lambda r=str(room): P.get("/debug/pd")["holds"][r]["reached"], 60, "the stall"
                    )
                    times[True].append(_ttft(P, healthy, pd, 530 + i))
                finally:
                    P.post("/debug/pd/release", params={"room": room}).raise_for_status()
                p, d = held.result(timeout=120)
                assert p.status_code == d.status_code == 200, (p.text, d.text)
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"TTFT with a stalled peer / without: {ratio:.2f} (medians of {times})")  # -s shows it
    assert ratio <= 1.5, (ratio, times)
    pd.settle(P, stalled, healthy, initial=cluster["initial"])


# ---- logprobs and n through PD -------------------------------------------------------------------
CHAT = [{"role": "user", "content": "What does a page of the cache hold? " * 12}]  # > 128 tokens


def both(prefill: Any, decode: Any, create: Any, pd: Any, **kw: Any) -> tuple[Any, Any]:
    """One openai-client call on both legs at once (the router's dispatch), the bootstrap fields and
    `ignore_eos` in extra_body; streamed responses are read to the end."""
    extra = {**pd.pd_body(prefill, {}), "ignore_eos": True, **kw.pop("extra_body", {})}
    if kw.get("n", 1) > 1:  # one room per choice, as sglang-router sends for chat
        extra |= {k: [extra[k]] * kw["n"] for k in ("bootstrap_host", "bootstrap_port")}
        extra["bootstrap_room"] = [extra["bootstrap_room"] + j for j in range(kw["n"])]

    def call(server: Any) -> Any:
        out = create(client(server))(model="tiny", extra_body=extra, **kw)
        return list(out) if kw.get("stream") else out

    with cf.ThreadPoolExecutor(2) as ex:
        p, d = ex.submit(call, prefill), ex.submit(call, decode)
        return p.result(), d.result()


def choice_lps(choices: list[Any]) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token, logprob, top alternatives) of every output token of these choices, in order."""
    out = []
    for choice in choices:
        for e in (choice.logprobs.content or []) if choice.logprobs else []:
            out.append((e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]))
    return out


def chat_lps(response: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """choice_lps of a response, or of its streamed chunks together."""
    chunks = response if isinstance(response, list) else [response]
    return choice_lps([choice for c in chunks for choice in c.choices])


def same_lps(got: list[Any], want: list[Any]) -> bool:
    def key(entries: list[Any]) -> list[Any]:
        return [(t, round(lp, 3), [(a, round(b, 3)) for a, b in top]) for t, lp, top in entries]

    return len(got) == len(want) and key(got) == key(want)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_through_pd_equal_colocated(cluster: dict[str, Any], pd: Any, stream: bool) -> None:
    """The first token's logprobs come from the prefill with the transferred state, the rest from
    the decode: together they are the colocated server's, streamed and not."""
    kw = {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    want = client(cluster["C"]).chat.completions.create(model="tiny", extra_body={"ignore_eos": True}, **kw)
    p, d = both(cluster["P128"], cluster["D1"], lambda c: c.chat.completions.create, pd, stream=stream, **kw)
    assert len(chat_lps(want)) == MAX_TOKENS and same_lps(chat_lps(d), chat_lps(want))
    assert same_lps(chat_lps(p), chat_lps(want)[:1])  # the prefill's own answer: the first token
    pd.settle(cluster["P128"], cluster["D1"], initial=cluster["initial"])


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_logprobs_through_pd_equal_colocated(cluster: dict[str, Any], pd: Any, max_tokens: int) -> None:
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) on a prompt the prefill chunks:
    the decode returns the prompt's logprobs, which only the prefill computed."""
    prompt = random_ids(300, seed=5)
    kw = {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 2, "temperature": 0}
    want = client(cluster["C"]).completions.create(model="tiny", extra_body={"ignore_eos": True}, **kw)
    _, d = both(cluster["P128"], cluster["D2"], lambda c: c.completions.create, pd, **kw)
    got, ref = d.choices[0].logprobs, want.choices[0].logprobs
    assert len(ref.tokens) == len(prompt) + max_tokens and got.tokens == ref.tokens
    assert got.token_logprobs[0] is None and got.token_logprobs[1:] == pytest.approx(
        ref.token_logprobs[1:], abs=1e-4
    )
    assert [sorted(t) for t in got.top_logprobs[1:]] == [sorted(t) for t in ref.top_logprobs[1:]]
    pd.settle(cluster["P128"], cluster["D2"], initial=cluster["initial"])


def test_generate_return_logprob_through_pd(cluster: dict[str, Any], pd: Any) -> None:
    """/generate: the decode returns the prompt's and the output's logprobs; the prefill leaves the
    prompt's out (sglang-router 0.3.2 prepends the prefill's list to the decode's)."""
    body = {
        "input_ids": random_ids(200, seed=6), "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
    }  # fmt: skip
    want = cluster["C"].post("/generate", json=body).json()["meta_info"]
    p, d = pd.send_pair(cluster["P256"], cluster["D1"], pd.pd_body(cluster["P256"], body), "/generate")
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    got = d.json()["meta_info"]
    assert p.json()["meta_info"]["input_token_logprobs"] == []
    assert len(got["input_token_logprobs"]) == 200 and len(got["output_token_logprobs"]) == 4
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [e[1] for e in got[key]] == [e[1] for e in want[key]]
        assert [e[0] for e in got[key]] == [
            None if e[0] is None else pytest.approx(e[0], abs=1e-4) for e in want[key]
        ]
    pd.settle(cluster["P256"], cluster["D1"], initial=cluster["initial"])


def test_n_logprobs_and_echo_through_the_router(cluster: dict[str, Any], pd: Any, router: Any) -> None:
    """What evaluation clients send, through sglang-router 0.3.2: chat `n` (a room per choice),
    completions echo logprobs and /generate return_logprob (the router merges the prefill's prompt
    logprobs into the decode's: they must come out once, not twice)."""
    r = router("LP", [cluster["P128"]], [cluster["D2"]])
    via = r.client(timeout=300)
    kw = {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 7, "n": 3}
    kw |= {"logprobs": True, "top_logprobs": 1}
    want = client(cluster["C"]).chat.completions.create(model="tiny", **kw)
    got = via.chat.completions.create(model="tiny", **kw)
    texts = [c.message.content for c in want.choices]
    assert len(set(texts)) > 1 and [c.message.content for c in got.choices] == texts
    for g, w in zip(got.choices, want.choices, strict=True):
        assert same_lps(choice_lps([g]), choice_lps([w]))
    # sglang-router 0.3.2 takes only text prompts on /v1/completions (token ids are a 422 there).
    kw = {"prompt": "A page of the cache holds " * 30, "max_tokens": 0, "echo": True, "logprobs": 1}
    got_c = via.completions.create(model="tiny", **kw).choices[0].logprobs
    want_c = client(cluster["C"]).completions.create(model="tiny", **kw).choices[0].logprobs
    assert len(got_c.tokens) > 128 and got_c.tokens == want_c.tokens
    assert got_c.token_logprobs[1:] == pytest.approx(want_c.token_logprobs[1:], abs=1e-4)
    prompt = random_ids(150, seed=8)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    body |= {"return_logprob": True, "logprob_start_len": 0}
    got_g = httpx.post(f"{r.base}/generate", json=body, timeout=300).json()["meta_info"]
    assert [e[1] for e in got_g["input_token_logprobs"]] == prompt
    pd.settle(cluster["P128"], cluster["D2"], initial=cluster["initial"])


def test_a_stop_string_in_the_first_token_ends_both_legs(
    cluster: dict[str, Any], pd: Any, tiny_model: Any
) -> None:
    """A stop string the first token already completes ends the request on both servers: the
    prefill's response still waits for its transfer (ending it early would abort the room under the
    decode server, which then fails the request)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    for seed in range(20):  # a prompt whose first greedy token has printable text
        prompt = random_ids(40, seed=100 + seed)
        text = tokenizer.decode(colocated(cluster["C"], prompt, pd, temperature=0, ignore_eos=True)[:1])
        if text.strip() and "\ufffd" not in text:
            break
    kw = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": [text]}
    p, d = both(cluster["P128"], cluster["D1"], lambda c: c.completions.create, pd, **kw)
    for leg in (p, d):
        assert (leg.choices[0].finish_reason, leg.choices[0].text) == ("stop", "")
    pd.settle(cluster["P128"], cluster["D1"], initial=cluster["initial"])
