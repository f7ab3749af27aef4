"""Prefix cache: TTFT and hit rate with the cache on against off, then cluster-wide through `dsv4 up`, one run.

    python bench/prefix.py                 # demo model, the default sizes (~4 min on 2 busy cores)
    python bench/prefix.py --quick         # fewer users and turns, one repeat (~1.5 min)
    python bench/prefix.py --parts engine  # only part 1 (--parts cluster: part 2, restart: part 3)

Part 1, engine: two `dsv4 serve` on the same checkpoint with the same engine settings (those of
examples/cpu-tiny.yaml, which `dsv4 up` uses in part 2), one of them with `--disable-radix-cache`, both up
for the whole part and measured in turn (the order alternates per repeat, which damps load drift on a
shared machine). Three workloads, every request a streamed /v1/chat/completions with greedy sampling,
`ignore_eos` and `--max-tokens` tokens, at most `--concurrency` requests in flight:
- chat: `--chat-users` users, each `--turns` turns; a turn sends the whole history (its earlier user
  messages and the assistant's replies as streamed back) plus a new user message of about
  `--turn-tokens` tokens of text;
- shared: `--shared-users` users, one request each: one system prompt of `--system-tokens` tokens (the
  same for every user), then a user message of its own: `--user-tokens` tokens of text and a question
  (by default the system prompt is ~90% of each prompt, the issue's setting; 0: the question only);
- shared-1: the shared workload with a system prompt of its own, one request at a time. At 4 in
  flight a closed loop's requests arrive together, a few ms apart: the first starts a step alone and
  the others wait for it, so TTFT there is the cache's gain plus queueing; one at a time it is the
  cache's gain alone.
The text is Python's help topics (`pydoc_data.topics`, which the demo model was trained on), cut by the
checkpoint's tokenizer to the token counts asked for; every repeat starts its prompts with its own tag, so
a repeat finds nothing cached by the one before it (and the untimed warm-up shares nothing with them).
Per request, on the client: TTFT (sent to the first chunk with content), end to end, and the response's
usage: prompt_tokens and `prompt_tokens_details.cached_tokens` where the server reports it. Per run:
requests/s and output tokens/s over the run's wall time, and the server's /metrics prefix-cache counters
before and after (`vllm:prefix_cache_{queries,hits}_total`, else dsv4's own series of
engine.metrics()['prefix_cache_queries'/'prefix_cache_hits']). Hit rate = cached / prompt tokens, from
each source. Target (shared workloads, ~90% of each prompt shared): TTFT p50 off / on >= 5x, reported
for both.

Part 2, cluster: `dsv4 up` on examples/cpu-tiny.yaml with this checkpoint, the router's prefill policy
`--router-policy` (default cache_aware, sglang-router 0.3.2's), once with 1 prefill server and once with
2 (+1 decode; `dsv4 up` gives prefill the first half of the cores, so 2 prefill servers share it). Both
workloads through the router (its own repeat tags). Cluster-wide hit rate: the prefill servers' /metrics
counters summed (the decode admits the transferred prompt and is left out), and from usage if the
response carries it; and of those hits, the share a server fetched from the other's cache
(`--prefix-cache-peers`, which `dsv4 up` gives every prefill server). Target: 2-prefill hit rate within
10 points of 1-prefill's. Every request
carries its conversation's `X-SMG-Routing-Key` (a chat user's, a shared-prompt user's), which
`--router-policy manual` keeps on one prefill server and the other policies ignore.

Part 3, restart: the chat workload's users send every turn but the last to a `dsv4 serve
--prefix-cache-dir` (part 1's settings; it also saves every 2 s while it serves), which is then
stopped with SIGTERM and writes its cache to the directory; each user's last turn, on the same
history, then goes to a server started on that directory and to one started without it (what a
restart costs without the file). TTFT and hit rate of that turn on each, and what the logs say was
saved (and how long each save while serving paused the engine) and imported, in how long.

Prints one table per part; writes the raw figures (requests.csv: one row per request; runs.csv: one row
per run with its /metrics deltas per server), ttft.png (TTFT CDF per workload, cache on against off) and
the server, cluster and router logs into `--out-dir`. Every request, start-up and stop has a bound;
every process is stopped at the end, on error too (and gets SIGTERM if this process dies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from procs import Proc, Procs, free_port, healthy, percentile, wait_until  # bench/procs.py

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

NAME = "bench"
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "engine" / "dsv4_engine" / "data" / "demo"
ROUTING_KEY = "X-SMG-Routing-Key"  # one per conversation (a chat user, a shared-prompt user)
SPEC = ROOT / "examples" / "cpu-tiny.yaml"
TTFT_TARGET = 5.0  # shared workload: TTFT p50 cache off / on
HIT_POINTS_TARGET = 10.0  # cluster: 2-prefill hit rate within this many points of 1-prefill's
WORKLOADS = ("chat", "shared")
SERIAL = "shared-1"  # part 1 only: the shared workload again, one request at a time (no queueing)
ENGINE_WORKLOADS = (*WORKLOADS, SERIAL)
QUESTIONS = ("What is {}?", "Tell me about {}.", "Explain {}.", "How does {} work in Python?")
# The prefix-cache counters on /metrics, the first present wins: vLLM's, then dsv4's (a counter, or the
# engine.metrics() gauge of the same count).
QUERY_SERIES = tuple(
    f"{n}prefix_cache_queries{t}" for n, t in (("vllm:", "_total"), ("dsv4_", "_total"), ("dsv4_engine_", ""))
)
HIT_SERIES = tuple(
    f"{n}prefix_cache_hits{t}" for n, t in (("vllm:", "_total"), ("dsv4_", "_total"), ("dsv4_engine_", ""))
)
PEER_SERIES = "dsv4_prefix_cache_peer_fetched_tokens_total"  # hits whose pages came from another server


# ---- workload ----------------------------------------------------------------------------------


class Text:
    """Python's help topics as one text, cut by the checkpoint's tokenizer."""

    def __init__(self, tokenizer_file: Path) -> None:
        import pydoc_data.topics

        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_file))
        topics = pydoc_data.topics.topics
        self.names = sorted(topics)
        self.text = "\n\n".join(topics[k] for k in self.names)
        self.enc = self.tok.encode(self.text, add_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def piece(self, start: int, tokens: int) -> str:
        """About `tokens` tokens of the text from token `start` (wrapping around)."""
        n = len(self.enc.ids)
        start %= n
        end = min(n, start + tokens)
        out = self.text[self.enc.offsets[start][0] : self.enc.offsets[end - 1][1]]
        return out if end - start == tokens else out + self.piece(0, tokens - (end - start))


@dataclass(frozen=True)
class Workload:
    system: str  # the shared system prompt (tag included)
    system_tokens: int
    questions: list[str]  # shared: one per user
    turns: list[list[str]]  # chat: per user, its user messages in order


def make_workload(text: Text, a: argparse.Namespace, tag: str) -> Workload:
    """Everything starts with `tag`, so no two tags share a cached page."""
    head = f"Session {tag}. You answer questions about Python from this reference.\n\n"
    body = text.piece(0, max(1, a.system_tokens - text.count(head)))
    system = head + body
    start = a.system_tokens + 1
    after = start + a.chat_users * a.turns * a.turn_tokens  # the shared users' own text: past the chat's
    questions = []
    for u in range(a.shared_users):
        own = f"{text.piece(after + u * a.user_tokens, a.user_tokens)}\n\n" if a.user_tokens else ""
        name = text.names[(7 * u) % len(text.names)]
        questions.append(f"{own}{QUESTIONS[u % len(QUESTIONS)].format(name)} (user {u})")
    turns: list[list[str]] = []
    for u in range(a.chat_users):
        msgs = []
        for t in range(a.turns):
            at = start + (u * a.turns + t) * a.turn_tokens
            name = text.names[(u * a.turns + t) % len(text.names)]
            lead = f"Session {tag}, user {u}, turn {t}. " if t == 0 else ""
            msgs.append(
                f"{lead}{text.piece(at, a.turn_tokens)}\n\n{QUESTIONS[t % len(QUESTIONS)].format(name)}"
            )
        turns.append(msgs)
    return Workload(system, text.count(system), questions, turns)


# ---- processes ---------------------------------------------------------------------------------


def engine_flags(spec: dict[str, Any]) -> list[str]:
    """The engine settings of the cluster's spec, as `dsv4 serve` flags (parts 1 and 2 alike)."""
    eng = spec["spec"]["engine"]
    flags = {
        "device": "--device",
        "dtype": "--dtype",
        "maxModelLen": "--max-model-len",
        "chunkedPrefillSize": "--chunked-prefill-size",
        "maxNumSeqs": "--max-num-seqs",
    }
    return [x for key, flag in flags.items() if key in eng for x in (flag, str(eng[key]))]


def serve(procs: Procs, model: Path, name: str, log_dir: Path, flags: list[str]) -> tuple[Proc, str]:
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from dsv4_operator.cli import main; sys.exit(main())"]
    cmd += ["serve", "--model", str(model), "--served-model-name", NAME, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "warning", "--grace-period", "5", *flags]
    proc = procs.spawn(name, cmd, port=port, log_path=log_dir / f"{name}.log", stop_timeout=60.0)
    return proc, proc.base


@dataclass
class Cluster:
    proc: Proc
    base: str  # the router
    prefill: list[str]  # the prefill servers' URLs
    decode: list[str]


UP_SERVER = re.compile(r"^dsv4 up\s+\S+\s+((?:prefill|decode)-\d+)\s+starting\s+pid \d+\s+(\S+)", re.M)


def up(procs: Procs, a: argparse.Namespace, spec: dict[str, Any], prefill: int) -> Cluster:
    """`dsv4 up` with `prefill` prefill servers and the router's prefill policy; returns once the router
    answers /v1/models."""
    name = f"prefix-bench-p{prefill}"
    spec = json.loads(json.dumps(spec))  # a copy
    spec["metadata"]["name"] = name
    s = spec["spec"]
    s["model"] = {"servedModelName": NAME, "hostPath": {"path": str(a.model)}}
    s["prefill"]["replicas"] = prefill
    s["router"]["prefillPolicy"] = a.router_policy
    s["engine"]["gracePeriodSeconds"] = 5
    log_dir = a.out_dir / "logs" / name
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    cmd = [sys.executable, "-m", "dsv4_operator.cli", "up", "-f", str(path), "--ports", "free"]
    cmd += ["--log-dir", str(log_dir)]
    proc = procs.spawn(f"dsv4 up ({prefill} prefill)", cmd, log_path=log_dir / "up.log", stop_timeout=120)
    deadline = time.monotonic() + a.start_timeout
    while time.monotonic() < deadline:
        proc.check()
        log = proc.log_path.read_text(errors="replace")
        m = re.search(r"^dsv4 up: endpoint (\S+)", log, re.M)
        if m:
            base = m.group(1).removesuffix("/v1")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/v1/models", timeout=5, trust_env=False).status_code == 200:
                    servers = dict(UP_SERVER.findall(log))
                    pre = [u for n, u in sorted(servers.items()) if n.startswith("prefill")]
                    dec = [u for n, u in sorted(servers.items()) if n.startswith("decode")]
                    if len(pre) != prefill:
                        raise SystemExit(
                            f"{proc.log_path}: {len(pre)} prefill servers started, asked {prefill}"
                        )
                    return Cluster(proc, base, pre, dec)
        time.sleep(0.5)  # polling what dsv4 up reports, bounded by --start-timeout
    raise SystemExit(f"dsv4 up did not serve within {a.start_timeout:.0f}s; log {proc.log_path}")


# ---- /metrics ----------------------------------------------------------------------------------


def scrape(base: str) -> tuple[float, float, float, str]:
    """(prefix-cache queries, hits, of those the tokens fetched from peers' caches, the series read)
    summed over label sets; NaN when absent (peer tokens: 0)."""
    try:
        r = httpx.get(f"{base}/metrics", timeout=10, trust_env=False)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        print(f"warning: {base}/metrics: {type(exc).__name__}: {exc}")
        return math.nan, math.nan, math.nan, "unreachable"
    values: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(?:\{[^}]*\})?\s+(\S+)", line)
        if m:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    peer = values.get(PEER_SERIES, 0.0)
    for q, h in zip(QUERY_SERIES, HIT_SERIES, strict=True):
        if q in values and h in values:
            return values[q], values[h], peer, q
    return math.nan, math.nan, peer, "absent"


# ---- requests ----------------------------------------------------------------------------------


@dataclass
class Result:
    part: str
    config: str
    workload: str
    rep: int
    user: int
    turn: int
    start: float = 0.0  # seconds after the run started
    ttft: float = math.nan
    e2e: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the response did not say
    output_tokens: int = 0
    reply: str = ""
    error: str = ""


async def chat(
    client: httpx.AsyncClient,
    base: str,
    messages: list[dict[str, str]],
    res: Result,
    a: argparse.Namespace,
    t0: float,
    key: str | None = None,
) -> None:
    """One streamed chat completion into `res`; `key`: the conversation's `X-SMG-Routing-Key`, which
    sglang-router's `manual` policy keeps on one server (the others ignore it, as dsv4 serve does)."""
    headers = {ROUTING_KEY: key} if key is not None else {}
    body = {
        "model": NAME,
        "messages": messages,
        "max_tokens": a.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    res.start = start - t0
    parts: list[str] = []
    chunks = 0

    async def stream() -> None:
        nonlocal chunks
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if math.isnan(res.ttft):
                            res.ttft = time.perf_counter() - start
                        parts.append(content)
                        chunks += 1
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                    res.output_tokens = usage.get("completion_tokens", res.output_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        res.cached_tokens = int(details["cached_tokens"])

    try:
        await asyncio.wait_for(stream(), a.request_timeout)
    except TimeoutError:
        res.error = f"timed out after {a.request_timeout:g} s"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    res.e2e = time.perf_counter() - start
    res.reply = "".join(parts)
    res.output_tokens = res.output_tokens or chunks  # no usage: a chunk with content counts as one token
    if not res.error and math.isnan(res.ttft):
        res.error = "no content"


@dataclass
class Run:
    part: str
    config: str
    workload: str
    rep: int
    wall: float
    results: list[Result]
    # server -> (queries, hits, peer-fetched tokens) delta
    metrics: dict[str, tuple[float, ...]] = field(default_factory=dict)
    series: str = ""


async def run_workload(
    base: str,
    wl: Workload,
    kind: str,
    a: argparse.Namespace,
    labels: tuple[str, str, int],
    histories: list[list[dict[str, str]]] | None = None,
    turns: range | None = None,
) -> tuple[float, list[Result]]:
    """chat: `turns` of each user's (default all), on `histories` (default empty; extended in place)."""
    part, config, rep = labels
    histories = histories if histories is not None else [[] for _ in wl.turns]
    sem = asyncio.Semaphore(1 if kind == SERIAL else a.concurrency)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=a.concurrency + 4)
    timeout = httpx.Timeout(a.request_timeout, connect=10)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()

        async def shared_user(u: int) -> None:
            res = Result(part, config, kind, rep, u, 0)
            messages = [
                {"role": "system", "content": wl.system},
                {"role": "user", "content": wl.questions[u]},
            ]
            async with sem:
                await chat(client, base, messages, res, a, t0, key=f"{config}-{rep}-shared-{u}")
            results.append(res)

        async def chat_user(u: int) -> None:
            history = histories[u]
            for t in turns if turns is not None else range(len(wl.turns[u])):
                history.append({"role": "user", "content": wl.turns[u][t]})
                res = Result(part, config, kind, rep, u, t)
                async with sem:
                    await chat(client, base, list(history), res, a, t0, key=f"{config}-{rep}-chat-{u}")
                results.append(res)
                if res.error:
                    return  # the history cannot go on without this reply
                history.append({"role": "assistant", "content": res.reply})

        if kind in ("shared", SERIAL):
            await asyncio.gather(*(shared_user(u) for u in range(len(wl.questions))))
        else:
            await asyncio.gather(*(chat_user(u) for u in range(len(wl.turns))))
        return time.perf_counter() - t0, results


def measure(
    base: str,
    servers: dict[str, str],
    wl: Workload,
    kind: str,
    a: argparse.Namespace,
    labels: tuple[str, str, int],
    histories: list[list[dict[str, str]]] | None = None,
    turns: range | None = None,
) -> Run:
    before = {name: scrape(url) for name, url in servers.items()}
    wall, results = asyncio.run(run_workload(base, wl, kind, a, labels, histories, turns))
    after = {name: scrape(url) for name, url in servers.items()}
    metrics = {n: tuple(after[n][i] - before[n][i] for i in range(3)) for n in servers}
    series = ",".join(sorted({after[n][3] for n in servers}))
    for name, url in servers.items():  # a server that died mid-run fails every request after: say which
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(f"{url}/health", timeout=5, trust_env=False)
            if r.status_code != 200:
                print(f"warning: {name} ({url}) answers /health {r.status_code} after {kind}: {r.text[:200]}")
    part, config, rep = labels
    return Run(part, config, kind, rep, wall, results, metrics, series)


def warm_up(base: str, text: Text, a: argparse.Namespace) -> None:
    """Untimed: a long prompt sharing no page with the workloads (one-time costs of a first prefill)."""

    async def go() -> None:
        async with httpx.AsyncClient(timeout=a.request_timeout, trust_env=False) as client:
            msgs = [{"role": "user", "content": "Warm-up. " + text.piece(50_000, a.system_tokens)}]
            res = Result("warm-up", "", "", 0, 0, 0)
            await chat(client, base, msgs, res, a, time.perf_counter())
            if res.error:
                raise SystemExit(f"warm-up request to {base} failed: {res.error}")

    asyncio.run(go())


# ---- figures -----------------------------------------------------------------------------------


@dataclass
class Figures:
    requests: int
    failed: int
    ttft_p50: float
    ttft_p90: float
    req_per_s: float
    tok_per_s: float
    prompt_tokens: int
    hit_usage: float  # NaN: no response said
    hit_metrics: float  # NaN: no counters
    per_server: dict[str, float]  # prompt tokens each server was asked (its queries counter)
    series: str
    peer_share: float  # of the hit tokens, those fetched from another server's cache (NaN: no hits)


def figures(runs: Sequence[Run]) -> Figures:
    results = [r for run in runs for r in run.results]
    ok = [r for r in results if not r.error]
    ttfts = [r.ttft for r in ok]
    wall = sum(run.wall for run in runs)
    prompt = sum(r.prompt_tokens for r in ok)
    with_cached = [r for r in ok if r.cached_tokens is not None]
    hit_usage = (
        sum(r.cached_tokens or 0 for r in with_cached) / sum(r.prompt_tokens for r in with_cached)
        if with_cached and sum(r.prompt_tokens for r in with_cached)
        else math.nan
    )
    per_server: dict[str, float] = {}
    hits = peer = 0.0
    for run in runs:
        for name, (q, h, p) in run.metrics.items():
            per_server[name] = per_server.get(name, 0.0) + q
            hits += h
            peer += p
    queries = sum(per_server.values())
    return Figures(
        requests=len(results),
        failed=len(results) - len(ok),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        req_per_s=len(ok) / wall if wall else math.nan,
        tok_per_s=sum(r.output_tokens for r in ok) / wall if wall else math.nan,
        prompt_tokens=prompt,
        hit_usage=hit_usage,
        hit_metrics=hits / queries if queries else math.nan,
        per_server=per_server,
        series=",".join(sorted({run.series for run in runs})),
        peer_share=peer / hits if hits else math.nan,
    )


def ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1000:.0f} ms"


def pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def ratio(num: float, den: float) -> str:
    return "n/a" if math.isnan(num) or math.isnan(den) or not den else f"{num / den:.2f}x"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def engine_table(by: dict[str, dict[str, Figures]], wl: Workload, a: argparse.Namespace) -> list[str]:
    lines = [
        row("workload: measure", "cache on", "cache off", "off / on", "target"),
        "|---|---:|---:|---:|---:|",
    ]
    for kind in ENGINE_WORKLOADS:
        on, off = by[kind]["on"], by[kind]["off"]
        mean_prompt = on.prompt_tokens / max(1, on.requests - on.failed)
        if kind == SERIAL:
            desc = "the same, one request at a time (TTFT without queueing behind other requests' steps)"
        elif kind == "shared":
            desc = f"{a.shared_users} users x 1, system prompt {wl.system_tokens} of {mean_prompt:.0f} tokens"
            desc += f" ({wl.system_tokens / mean_prompt:.0%} shared)" if mean_prompt else ""
        else:
            desc = f"{a.chat_users} users x {a.turns} turns, mean prompt {mean_prompt:.0f} tokens"
        lines.append(row(f"**{kind}**: {desc}", "", "", "", ""))
        ok = on.ttft_p50 and off.ttft_p50 / on.ttft_p50 >= TTFT_TARGET
        target = f">= {TTFT_TARGET:g}x {verdict(bool(ok))}" if kind != "chat" else ""
        lines += [
            row(
                f"{kind}: TTFT p50",
                ms(on.ttft_p50),
                ms(off.ttft_p50),
                ratio(off.ttft_p50, on.ttft_p50),
                target,
            ),
            row(f"{kind}: TTFT p90", ms(on.ttft_p90), ms(off.ttft_p90), ratio(off.ttft_p90, on.ttft_p90), ""),
            row(
                f"{kind}: requests/s",
                f"{on.req_per_s:.2f}",
                f"{off.req_per_s:.2f}",
                ratio(off.req_per_s, on.req_per_s),
                "",
            ),
            row(
                f"{kind}: output tokens/s",
                f"{on.tok_per_s:.1f}",
                f"{off.tok_per_s:.1f}",
                ratio(off.tok_per_s, on.tok_per_s),
                "",
            ),
            row(f"{kind}: hit rate, usage cached_tokens", pct(on.hit_usage), pct(off.hit_usage), "", ""),
            row(f"{kind}: hit rate, /metrics", pct(on.hit_metrics), pct(off.hit_metrics), "", ""),
            row(
                f"{kind}: requests (failed)",
                f"{on.requests} ({on.failed})",
                f"{off.requests} ({off.failed})",
                "",
                "",
            ),
        ]
    return lines


def cluster_table(by: dict[str, dict[str, Figures]]) -> list[str]:
    lines = [
        row("workload: measure", "1 prefill", "2 prefill", "2 - 1", "target"),
        "|---|---:|---:|---:|---:|",
    ]
    for kind in WORKLOADS:
        one, two = by[kind]["p1"], by[kind]["p2"]
        diff = 100 * (two.hit_metrics - one.hit_metrics)
        target = f"within {HIT_POINTS_TARGET:g} points {verdict(abs(diff) <= HIT_POINTS_TARGET)}"
        udiff = 100 * (two.hit_usage - one.hit_usage)

        def split(f: Figures) -> str:
            return " / ".join(f"{v:.0f}" for _, v in sorted(f.per_server.items()))

        lines += [
            row(
                f"{kind}: hit rate, prefill /metrics summed",
                pct(one.hit_metrics),
                pct(two.hit_metrics),
                "n/a" if math.isnan(diff) else f"{diff:+.1f} points",
                target,
            ),
            row(
                f"{kind}: hit rate, usage through the router",
                pct(one.hit_usage),
                pct(two.hit_usage),
                "n/a" if math.isnan(udiff) else f"{udiff:+.1f} points",
                "",
            ),
            row(f"{kind}: prompt tokens per prefill server", split(one), split(two), "", ""),
            row(
                f"{kind}: of the hits, fetched from the other's cache",
                pct(one.peer_share),
                pct(two.peer_share),
                "",
                "",
            ),
            row(
                f"{kind}: TTFT p50", ms(one.ttft_p50), ms(two.ttft_p50), ratio(two.ttft_p50, one.ttft_p50), ""
            ),
            row(
                f"{kind}: TTFT p90", ms(one.ttft_p90), ms(two.ttft_p90), ratio(two.ttft_p90, one.ttft_p90), ""
            ),
            row(
                f"{kind}: requests/s",
                f"{one.req_per_s:.2f}",
                f"{two.req_per_s:.2f}",
                ratio(two.req_per_s, one.req_per_s),
                "",
            ),
            row(
                f"{kind}: requests (failed)",
                f"{one.requests} ({one.failed})",
                f"{two.requests} ({two.failed})",
                "",
                "",
            ),
        ]
    return lines


CSV_COLUMNS = [
    "part",
    "config",
    "workload",
    "rep",
    "user",
    "turn",
    "start_s",
    "ttft_s",
    "e2e_s",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "error",
]


def write_csv(out: Path, runs: Sequence[Run]) -> None:
    with (out / "requests.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for run in runs:
            for r in sorted(run.results, key=lambda r: (r.user, r.turn)):
                cached = "" if r.cached_tokens is None else r.cached_tokens
                w.writerow(
                    [
                        *(r.part, r.config, r.workload, r.rep, r.user, r.turn),
                        *(f"{r.start:.4f}", f"{r.ttft:.6f}", f"{r.e2e:.6f}"),
                        *(r.prompt_tokens, cached, r.output_tokens, r.error),
                    ]
                )
    with (out / "runs.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                *("part", "config", "workload", "rep", "wall_s", "requests", "server", "series"),
                *("queries", "hits", "peer_tokens"),
            ]
        )
        for run in runs:
            for server, (q, h, p) in sorted(run.metrics.items()):
                head = [run.part, run.config, run.workload, run.rep, f"{run.wall:.3f}", len(run.results)]
                w.writerow([*head, server, run.series, q, h, p])


def plot(path: Path, runs: Sequence[Run]) -> None:
    """TTFT CDF per workload, cache on against off (part 1), log x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    kinds = ENGINE_WORKLOADS
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False, sharey=True)
    for ax, kind in zip(axes[0], kinds, strict=True):
        for config, color in (("on", "tab:blue"), ("off", "tab:orange")):
            xs = sorted(
                r.ttft * 1000
                for run in runs
                if run.part == "engine" and run.workload == kind and run.config == config
                for r in run.results
                if not r.error
            )
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                label = f"cache {config} (p50 {percentile(xs, 50):.0f} ms)"
                ax.step(xs, ys, where="post", color=color, label=label)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_title(kind)
        ax.set_xlabel("TTFT (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    axes[0][0].set_ylabel("fraction of requests")
    fig.suptitle("time to first token, prefix cache on vs off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- main --------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEMO, help="checkpoint folder (default: the bundled demo)")
    p.add_argument(
        "--parts",
        nargs="+",
        choices=("engine", "cluster", "restart"),
        default=["engine", "cluster", "restart"],
    )
    p.add_argument("--system-tokens", type=int, default=2048, help="shared: the system prompt's tokens")
    p.add_argument("--shared-users", type=int, default=32)
    p.add_argument(
        "--user-tokens",
        type=int,
        default=224,
        help="shared: tokens of text (different per user) before each user's question; the default makes "
        "the system prompt ~90%% of each prompt (0: the question only, ~99%%)",
    )
    p.add_argument("--chat-users", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--turn-tokens", type=int, default=192, help="chat: tokens of text in each user message")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens of every request")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    p.add_argument("--repeat", type=int, default=3, help="part 1: runs per workload and config (alternating)")
    p.add_argument("--router-policy", default="cache_aware", help="part 2: the router's prefill policy")
    p.add_argument("--request-timeout", type=float, default=180.0, help="seconds, each request")
    p.add_argument(
        "--start-timeout", type=float, default=300.0, help="seconds for a server or cluster to serve"
    )
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "out" / "prefix")
    p.add_argument("--quick", action="store_true", help="16 shared users, 4 chat users x 6 turns, one repeat")
    a = p.parse_args(argv)
    if a.quick:
        a.shared_users, a.chat_users, a.turns, a.repeat = 16, 4, 6, 1
    return a


def engine_part(a: argparse.Namespace, text: Text, procs: Procs, flags: list[str]) -> list[Run]:
    log_dir = a.out_dir / "logs"
    on, on_url = serve(procs, a.model, "serve-cache-on", log_dir, flags)
    off, off_url = serve(procs, a.model, "serve-cache-off", log_dir, [*flags, "--disable-radix-cache"])
    urls = {"on": on_url, "off": off_url}
    for proc, url in ((on, on_url), (off, off_url)):
        wait_until(healthy(url), [on, off], a.start_timeout, f"{proc.name} to become healthy")
    for url in urls.values():
        warm_up(url, text, a)
    runs: list[Run] = []
    for rep in range(a.repeat):
        wl = make_workload(text, a, f"e{rep}")
        serial = make_workload(text, a, f"e{rep}-1")  # its own system prompt: nothing cached before
        for kind in ENGINE_WORKLOADS:
            for config in ("on", "off")[:: 1 if rep % 2 == 0 else -1]:
                print(f"engine, repeat {rep + 1}/{a.repeat}: {kind}, cache {config} ...", flush=True)
                load = serial if kind == SERIAL else wl
                runs.append(
                    measure(urls[config], {config: urls[config]}, load, kind, a, ("engine", config, rep))
                )
    procs.stop(on)
    procs.stop(off)
    return runs


def cluster_part(a: argparse.Namespace, text: Text, procs: Procs, spec: dict[str, Any]) -> list[Run]:
    runs: list[Run] = []
    for n in (1, 2):
        print(f"cluster: dsv4 up with {n} prefill, router prefill policy {a.router_policy} ...", flush=True)
        cl = up(procs, a, spec, n)
        try:
            warm_up(cl.base, text, a)
            servers = {f"prefill-{i}": url for i, url in enumerate(cl.prefill)}
            wl = make_workload(text, a, "c")  # the same prompts on both clusters
            for kind in WORKLOADS:
                print(f"cluster, {n} prefill: {kind} ...", flush=True)
                runs.append(measure(cl.base, servers, wl, kind, a, ("cluster", f"p{n}", 0)))
        finally:
            procs.stop(cl.proc)
    return runs


SAVED = re.compile(
    r"prefix cache: saved (\d+) prefixes to \S+ in ([\d.]+)s \(read between steps in (\d+) part\(s\), the "
    r"longest ([\d.]+)s"
)
IMPORTED = re.compile(r"prefix cache: imported (\d+) of (\d+) prefixes from \S+ in ([\d.]+)s")


SAVE_INTERVAL = 2  # seconds: the first server also saves while it serves (often, to measure the pauses)


@dataclass
class Restart:
    runs: list[Run]
    saved: str  # what the draining server's log says it wrote, and the file's size
    imported: str  # what the restarted server's log says it read


def restart_part(a: argparse.Namespace, text: Text, procs: Procs, flags: list[str]) -> Restart:
    """Part 3: every chat user's turns but the last on a server with --prefix-cache-dir, which then
    drains (SIGTERM) and writes its cache; then each user's last turn, the same histories, on a server
    started on that directory and on one started without it (a restart that loses the cache)."""
    log_dir, cache_dir = a.out_dir / "logs", a.out_dir / "restart-cache"
    for old in cache_dir.glob("*"):
        old.unlink()
    keep = [*flags, "--prefix-cache-dir", str(cache_dir), "--log-level", "info"]
    wl = make_workload(text, a, "r")
    saving = [*keep, "--prefix-cache-save-interval", str(SAVE_INTERVAL)]
    histories: list[list[dict[str, str]]] = [[] for _ in wl.turns]
    before, url = serve(procs, a.model, "restart-before", log_dir, saving)
    wait_until(healthy(url), [before], a.start_timeout, f"{before.name} to become healthy")
    warm_up(url, text, a)
    print(f"restart: turns 1-{a.turns - 1} of {a.chat_users} chat users, then SIGTERM ...", flush=True)
    asyncio.run(run_workload(url, wl, "chat", a, ("restart", "before", 0), histories, range(a.turns - 1)))
    procs.stop(before)
    saves = SAVED.findall(before.log_path.read_text(errors="replace"))  # the drain's is the last
    size = sum(f.stat().st_size for f in cache_dir.glob("*.safetensors"))
    # Per save while serving: the parts its read took, and the longest, the engine's longest pause.
    parts = [int(n) for _, _, n, _ in saves[:-1]]
    pauses = [float(t) for _, _, _, t in saves[:-1]]
    saved = (
        f"{saves[-1][0]} prefixes, {size / 2**20:.1f} MiB, in {float(saves[-1][1]):.2f} s; "
        + (
            f"{len(pauses)} saves while serving, read in {min(parts)}-{max(parts)} parts between steps, "
            f"each pausing the engine at most {max(pauses) * 1000:.0f} ms"
            if pauses
            else "no save while serving"
        )
        if saves
        else "nothing (see its log)"
    )
    runs, imported = [], ""
    for config, extra in (("saved cache", keep), ("cold", flags)):
        proc, url = serve(procs, a.model, f"restart-{config.split()[0]}", log_dir, extra)
        wait_until(healthy(url), [proc], a.start_timeout, f"{proc.name} to become healthy")
        warm_up(url, text, a)
        print(f"restart: the last turn of every user on a server started {config} ...", flush=True)
        copies = [list(h) for h in histories]
        runs.append(
            measure(
                url, {config: url}, wl, "chat", a, ("restart", config, 0), copies, range(a.turns - 1, a.turns)
            )
        )
        if config == "saved cache":
            m = IMPORTED.search(proc.log_path.read_text(errors="replace"))
            imported = f"{m[1]} of {m[2]} prefixes in {float(m[3]):.2f} s" if m else "nothing (see its log)"
        procs.stop(proc)
    return Restart(runs, saved, imported)


def restart_table(r: Restart, a: argparse.Namespace) -> list[str]:
    on, off = (figures([run]) for run in r.runs)
    return [
        row("last turn after the restart", "saved cache", "cold", "cold / saved"),
        "|---|---:|---:|---:|",
        row("TTFT p50", ms(on.ttft_p50), ms(off.ttft_p50), ratio(off.ttft_p50, on.ttft_p50)),
        row("TTFT p90", ms(on.ttft_p90), ms(off.ttft_p90), ratio(off.ttft_p90, on.ttft_p90)),
        row("hit rate, usage cached_tokens", pct(on.hit_usage), pct(off.hit_usage), ""),
        row("requests (failed)", f"{on.requests} ({on.failed})", f"{off.requests} ({off.failed})", ""),
    ]


def by_config(
    runs: Sequence[Run], part: str, kinds: Sequence[str] = WORKLOADS
) -> dict[str, dict[str, Figures]]:
    out: dict[str, dict[str, Figures]] = {}
    for kind in kinds:
        configs = sorted({r.config for r in runs if r.part == part and r.workload == kind})
        out[kind] = {
            c: figures([r for r in runs if r.part == part and r.workload == kind and r.config == c])
            for c in configs
        }
    return out


@contextlib.contextmanager
def stopping(procs: Procs) -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops every process
    try:
        yield
    finally:
        procs.stop_all()
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t0, load = time.monotonic(), os.getloadavg()
    (a.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    text = Text(a.model / "tokenizer.json")
    spec = yaml.safe_load(SPEC.read_text())
    flags = engine_flags(spec)
    procs = Procs()
    runs: list[Run] = []
    with stopping(procs):
        if "engine" in a.parts:
            runs += engine_part(a, text, procs, flags)
        if "cluster" in a.parts:
            runs += cluster_part(a, text, procs, spec)
        restart = restart_part(a, text, procs, flags) if "restart" in a.parts else None
    if restart is not None:
        runs += restart.runs
    write_csv(a.out_dir, runs)
    wl = make_workload(text, a, "e0")
    print(
        f"\nprefix: {a.model.name} checkpoint, engine settings of {SPEC.name} ({' '.join(flags)}); streamed "
        f"/v1/chat/completions, {a.max_tokens} output tokens each (greedy, ignore_eos), at most {a.concurrency} in "
        f"flight; chat turns {a.turn_tokens} tokens of text + a question; load average {load[0]:.2f} / "
        f"{os.getloadavg()[0]:.2f} (start / end), {os.cpu_count()} CPUs; {time.monotonic() - t0:.0f} s"
    )
    if "engine" in a.parts:
        print(f"\npart 1, engine: dsv4 serve with the prefix cache on and off, {a.repeat} repeat(s) each\n")
        print("\n".join(engine_table(by_config(runs, "engine", ENGINE_WORKLOADS), wl, a)))
        plot(a.out_dir / "ttft.png", runs)
    if "cluster" in a.parts:
        print(
            f"\npart 2, cluster: dsv4 up ({SPEC.name}, 1 decode), router prefill policy {a.router_policy}; "
            f"hit rate = prefill servers' /metrics prefix-cache counters summed\n"
        )
        print("\n".join(cluster_table(by_config(runs, "cluster"))))
    if restart is not None:
        print(
            f"\npart 3, restart: {a.chat_users} chat users' first {a.turns - 1} turns on dsv4 serve "
            f"--prefix-cache-dir, SIGTERM (saved {restart.saved}), then every user's last turn on a server "
            f"started on that directory (imported {restart.imported}) and on one started without it\n"
        )
        print("\n".join(restart_table(restart, a)))
    series = sorted({run.series for run in runs})
    print(f"\n/metrics series read: {', '.join(series)}; raw figures, plot and logs: {a.out_dir}")
    failed = sum(1 for run in runs for r in run.results if r.error)
    if failed:
        first = next(r for run in runs for r in run.results if r.error)
        print(
            f"warning: {failed} requests failed, e.g. {first.part}/{first.config}/{first.workload}: {first.error}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
