"""Serving benchmark: N concurrent streaming clients against `dsv4 serve`, versus offline `LLM.generate`.

    python bench/serve.py [--preset small] [--clients 32] [--prompt-len 128 512] [--output-len 64]
    python bench/serve.py --base-url http://127.0.0.1:8000 [--model NAME] [--request-rate 4]

Both runs use the same prompts (random token ids, seeded), greedy sampling and `ignore_eos`, so they
generate exactly the same number of tokens. The offline run is one `LLM.generate` call over all prompts
in this process, on the thread that built the `LLM` (as the server loads and steps its engine on one
thread: docs/server.md says why); the served run sends every
prompt at once, each from its own streaming client, to `dsv4 serve` (a subprocess with the same engine
options) on `/v1/completions` with `stream_options.continuous_usage_stats`, so each chunk says how
many tokens it carries. Offline and served runs alternate `--repeat` times and the medians are
compared, which damps load drift on a shared machine. Client-side TTFT is request start to first
token; ITL is the gap between chunks divided by the tokens the chunk carries. Prints one table.

`--base-url` measures a server that is already running (any OpenAI-compatible `/v1/completions`, e.g.
`dsv4 up`'s router) instead: no checkpoint, no offline run, served numbers only. `--request-rate R`
sends the requests as a Poisson process of R requests/s (exponential gaps, seeded by `--seed`) instead of
all at once; TTFT is still measured from the moment each request is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

TARGET_RATIO = 0.8


@dataclass
class Trace:
    start: float
    first: float | None = None
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in chunk)
    tokens: int = 0
    end: float = 0.0
    error: str | None = None


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """When each request is sent, in seconds from the start: all at once for an infinite rate, else a
    Poisson process of `rate` requests/s (exponential gaps), reproducible under `seed`."""
    if n <= 0:
        return []
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    rng = random.Random(seed)
    offsets, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids (BOS/EOS/specials) so prompts are ordinary text tokens.
    return [[rng.randrange(16, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def offline(llm: Any, prompts: list[list[int]], out_len: int) -> tuple[float, int]:
    """One LLM.generate over all prompts, on this thread (the one that built `llm`)."""
    from dsv4_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: Path, port: int, engine_flags: list[str], log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "import sys; from dsv4_operator.cli import main; sys.exit(main())"]
    cmd += ["serve", "--model", str(ckpt), "--served-model-name", "bench", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "warning", *engine_flags]
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    with log_path.open("wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"dsv4 serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("dsv4 serve did not become healthy")


async def one_client(
    client: httpx.AsyncClient, base: str, prompt: list[int], out_len: int, model: str = "bench"
) -> Trace:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": out_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    trace = Trace(start=time.perf_counter())
    seen = 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or {}
            # Without continuous usage stats (other servers), a chunk with text counts as one token.
            texts = [c.get("text") for c in chunk.get("choices") or []]
            if not texts:  # the closing usage-only chunk: a count, not an arrival
                seen = max(seen, usage.get("completion_tokens", seen))
                continue
            done = usage.get("completion_tokens", seen + (1 if any(texts) else 0))
            if done > seen:
                trace.first = trace.first or now
                trace.arrivals.append((now, done - seen))
                seen = done
    trace.tokens, trace.end = seen, time.perf_counter()
    return trace


async def served(
    base: str,
    prompts: list[list[int]],
    out_len: int,
    *,
    model: str = "bench",
    offsets: list[float] | None = None,
    keep_going: bool = False,
) -> tuple[float, list[Trace]]:
    """Each prompt sent at its offset (default: all at once). With `keep_going`, a failed request is a
    Trace with `error` set instead of aborting the run."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    offsets = offsets or [0.0] * len(prompts)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()

        async def at(offset: float, prompt: list[int]) -> Trace:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            try:
                return await one_client(client, base, prompt, out_len, model)
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                if not keep_going:
                    raise
                return Trace(start=time.perf_counter(), end=time.perf_counter(), error=repr(e))

        traces = await asyncio.gather(*(at(o, p) for o, p in zip(offsets, prompts, strict=True)))
        return time.perf_counter() - start, list(traces)


def itls(traces: list[Trace]) -> list[float]:
    gaps: list[float] = []
    for t in traces:
        for (prev, _), (now, n) in zip(t.arrivals, t.arrivals[1:], strict=False):
            gaps.extend([(now - prev) / n] * n)
    return gaps


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def latency_rows(traces: list[Trace]) -> list[tuple[str, str]]:
    ttfts = [t.first - t.start for t in traces if t.first is not None]
    gaps = itls(traces)
    return [
        ("TTFT p50 / p99", f"{percentile(ttfts, 50) * 1000:.1f} / {percentile(ttfts, 99) * 1000:.1f} ms"),
        ("ITL p50 / p99", f"{percentile(gaps, 50) * 1000:.1f} / {percentile(gaps, 99) * 1000:.1f} ms"),
    ]


def rate_label(rate: float) -> str:
    return "inf (all at once)" if rate == float("inf") else f"{rate:g}/s, Poisson"


def first_model(base: str) -> str:
    r = httpx.get(f"{base}/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def measure_endpoint(a: argparse.Namespace) -> int:
    """--base-url: the served half only, against a server someone else started."""
    base = a.base_url.rstrip("/").removesuffix("/v1")
    model = a.model or first_model(base)
    vocab = a.vocab_size
    if vocab is None and a.checkpoint is not None:
        vocab = json.loads((a.checkpoint / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(a.clients, a.prompt_len[0], a.prompt_len[1], vocab or 512, a.seed)
    runs: list[tuple[float, list[Trace]]] = []
    for i in range(a.repeat):
        print(f"run {i + 1}/{a.repeat}: {len(prompts)} streaming requests against {base} ...", flush=True)
        offsets = arrival_offsets(len(prompts), a.request_rate, a.seed + i)
        runs.append(
            asyncio.run(served(base, prompts, a.output_len, model=model, offsets=offsets, keep_going=True))
        )
    all_traces = [t for _, traces in runs for t in traces]
    failed = [t for t in all_traces if t.error is not None]
    tps = [sum(t.tokens for t in traces) / wall for wall, traces in runs]
    plens = [len(x) for x in prompts]
    rows = [
        ("endpoint / model", f"{base} / {model}"),
        (
            "requests per run",
            f"{len(prompts)} (prompt {min(plens)}-{max(plens)} tokens, mean {statistics.mean(plens):.0f}; "
            f"{a.output_len} output tokens each, greedy, ignore_eos)",
        ),
        ("request rate", rate_label(a.request_rate)),
        ("completed / failed", f"{len(all_traces) - len(failed)} / {len(failed)}"),
        ("output tokens", str(sum(t.tokens for t in all_traces))),
        ("served tok/s", " / ".join(f"{x:.1f}" for x in tps) + f"  (median {statistics.median(tps):.1f})"),
        *latency_rows([t for t in all_traces if t.error is None]),
    ]
    print(f"\nendpoint benchmark ({a.repeat} runs)")
    print(table(rows))
    for t in failed[:3]:
        print(f"failed request: {t.error}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--checkpoint", type=Path, help="reuse a checkpoint instead of writing one")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(128, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=2, help="alternating offline/served runs (medians reported)")
    p.add_argument(
        "--work-dir", type=Path, help="where the checkpoint and server log go (default: a temp dir)"
    )
    p.add_argument(
        "--base-url",
        help="measure this running server (e.g. http://127.0.0.1:8000, `dsv4 up`'s router) instead of "
        "starting one; no offline run",
    )
    p.add_argument("--model", help="model name to send with --base-url (default: the first of /v1/models)")
    p.add_argument(
        "--vocab-size",
        type=int,
        help="random prompt ids are drawn below this with --base-url (default: --checkpoint's config, else 512)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s as a seeded Poisson process (default: inf, every request at once)",
    )
    a = p.parse_args(argv)
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    if a.base_url:
        return measure_endpoint(a)

    work = a.work_dir or Path(tempfile.mkdtemp(prefix="dsv4-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = a.checkpoint
    if ckpt is None:
        from dsv4_engine.make_tiny import make_tiny

        ckpt = make_tiny(work / a.preset, seed=a.seed, preset=a.preset)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(a.clients, a.prompt_len[0], a.prompt_len[1], vocab, a.seed)

    from dsv4_engine.llm import LLM
    from dsv4_engine.sampling_params import SamplingParams

    llm = LLM(str(ckpt), max_num_seqs=a.max_num_seqs)
    llm.generate(
        [prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=2)
    )  # warm-up, as the server does
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = work / "serve.log"
    proc = start_server(ckpt, port, ["--max-num-seqs", str(a.max_num_seqs)], log_path)
    runs: list[tuple[float, int, float, list[Trace]]] = []
    try:
        wait_healthy(base, proc, 600)
        # Alternate offline and served runs: on a shared machine, load drifts; medians damp it.
        for i in range(a.repeat):
            print(f"run {i + 1}/{a.repeat}: offline LLM.generate over {len(prompts)} prompts ...", flush=True)
            off_wall, off_tokens = offline(llm, prompts, a.output_len)
            print(f"run {i + 1}/{a.repeat}: {a.clients} streaming clients against dsv4 serve ...", flush=True)
            offsets = arrival_offsets(len(prompts), a.request_rate, a.seed + i)
            srv_wall, traces = asyncio.run(served(base, prompts, a.output_len, offsets=offsets))
            runs.append((off_wall, off_tokens, srv_wall, traces))
    finally:
        proc.terminate()
        proc.wait(120)

    off_tps = [tokens / wall for wall, tokens, _, _ in runs]
    srv_tps = [sum(t.tokens for t in traces) / wall for _, _, wall, traces in runs]
    all_traces = [t for _, _, _, traces in runs for t in traces]
    ratio = statistics.median(srv_tps) / statistics.median(off_tps)
    plens = [len(x) for x in prompts]
    served_label = f"served, {a.clients}-way streaming"
    if a.request_rate != float("inf"):  # arrivals spread out: the ratio to offline is no longer the target's
        served_label = f"served, {a.clients} streaming at {a.request_rate:g}/s"
    rows = [
        ("preset / checkpoint", f"{a.preset} / {ckpt}"),
        (
            "requests per run",
            f"{len(prompts)} (prompt {min(plens)}-{max(plens)} tokens, mean {statistics.mean(plens):.0f}; "
            f"{a.output_len} output tokens each, greedy, ignore_eos)",
        ),
        (
            "offline LLM.generate tok/s",
            " / ".join(f"{x:.1f}" for x in off_tps) + f"  (median {statistics.median(off_tps):.1f})",
        ),
        (
            f"{served_label} tok/s",
            " / ".join(f"{x:.1f}" for x in srv_tps) + f"  (median {statistics.median(srv_tps):.1f})",
        ),
        *latency_rows(all_traces),
        ("served / offline (medians)", f"{ratio:.2f} (target >= {TARGET_RATIO})"),
    ]
    print(f"\ndsv4 serve benchmark ({a.repeat} alternating runs; server log: {log_path})")
    print(table(rows))
    short = [i for i, (_, tokens, _, traces) in enumerate(runs) if sum(t.tokens for t in traces) != tokens]
    if short:
        print(f"\nwarning: runs {short} served a different number of tokens than offline generated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
