"""PD transfer of one request's paged KV and state over Mooncake (TCP, two processes on 127.0.0.1), one run.

    python bench/pd_transfer.py                       # small preset, one 4096-token request, 20 repeats
    python bench/pd_transfer.py --preset tiny --tokens 512 --repeats 3 --no-prefill   # quick
    python bench/pd_transfer.py --sweep 30            # also the tuning table: lanes x entries per call x size

This process is the prefill side; it starts the decode side (this script with --serve) as a second
process. Both build the same paged pools (fp32 on CPU, as the engine uses) and place the request the
same way a PD pair would: prefill by chunked prefill, decode by pre-allocation. Cases:
- fresh pools: page ids contiguous, so each state type merges into one entry per buffer;
- fragmented: two other requests grown page by page in turn and one freed before the request arrives,
  on both sides with different offsets, so no two consecutive pages merge (the worst case);
- fragmented, staged: what a server does with such pages (`transfer.stage_pays` picks it): pack them
  into one registered buffer (`protocol.stage_segments` with the `kernels/pages.cpp` copy), one
  entry, the receiver's unpack (both costs included);
- ceiling: the same bytes as one entry between two registered buffers, the best Mooncake's TCP
  transport does for this size whatever the plan;
against memcpy of the same bytes (a torch copy in-process) and `iperf3 -n <same bytes>` on loopback
(its sender's rate; see iperf3_once). Both sides use one torch thread while transferring (they share
the cores). The first write to a new peer (the handshake) is reported apart from steady-state writes (median and
p90 of --repeats). Every case checks the transferred pages byte for byte (a blake2b digest on each
side). The per-request transfer is set against an LLMEngine prefill of the same prompt (max_tokens=1);
the default checkpoint is written once by make_tiny under `$DSV4_CACHE` (default ~/.cache/dsv4)/models.
Targets (>= 70% of iperf3 from fresh pools, >= 50% fragmented, each on the path the server picks for
it) print PASS/MISS; speed never fails a run.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

from dsv4_engine.disagg.protocol import stage_segments, staged_bytes
from dsv4_engine.disagg.transfer import (
    DEFAULT_MAX_ENTRIES,
    Entries,
    MooncakeTransport,
    apply_env_defaults,
    plan_writes,
    stage_pays,
)
from dsv4_engine.memory import Dsv4MemoryLayout, ExtendSpec, PagedMemory, StateType, dsv4_state_payloads
from dsv4_engine.memory.sizing import fixed_pool_sizes
from dsv4_engine.memory.staging import gather_pages, scatter_pages
from dsv4_engine.memory.state_tail import cdiv

HOST = "127.0.0.1"
WARMUP = 3  # untimed writes after the first: the next few are still slow (tiny preset: 2 ms, then 0.55)
TARGETS = {"fresh": 0.70, "fragmented": 0.50}  # of iperf3's bytes/s


# ---- one side's memory -------------------------------------------------------------------------


def _grow(mem: PagedMemory, reqs: list[int], tokens: int) -> None:
    """Chunked prefill of each request to `tokens`, one page per step, the requests taking turns."""
    p = mem.layout.page_size
    for lo in range(0, tokens, p):
        for r in reqs:
            mem.allocator.alloc_extend([ExtendSpec(r, lo, min(lo + p, tokens))])


def _fragment(mem: PagedMemory, tokens: int, shift: bool) -> None:
    """Leave every other full page free: two requests grown in turn, then one freed. `shift` offsets
    the holes by one page, so the two sides' page ids differ."""
    alloc = mem.allocator
    if shift:
        _grow(mem, [alloc.alloc_request()], mem.layout.page_size)
    a, b = alloc.alloc_request(), alloc.alloc_request()
    _grow(mem, [a, b], tokens)
    alloc.free(a)


def _words(buf: torch.Tensor) -> torch.Tensor:
    """A pool buffer as [pages, int64 words]: index_copy_ of 8-byte elements is ~5x faster than bytes."""
    return buf.view(buf.shape[0], -1).view(torch.int64)


@dataclass
class Side:
    mem: PagedMemory
    pages: dict[StateType, list[int]]
    staging: torch.Tensor

    @classmethod
    def build(cls, config: dict, tokens: int, role: str, fragmented: bool) -> Side:
        layout = Dsv4MemoryLayout.from_config(config, kv_dtype=torch.float32)
        p = layout.page_size
        sizes = fixed_pool_sizes(layout, 2 * cdiv(tokens, p) + 2, max_reqs=4, max_batched_tokens=p)
        mem = PagedMemory.build(layout, sizes, max_reqs=4, max_ctx=cdiv(tokens, p) * p + p)
        if fragmented:
            _fragment(mem, tokens, shift=role == "decode")
        r = mem.allocator.alloc_request()
        if role == "prefill":
            _grow(mem, [r], tokens)
        else:
            mem.allocator.alloc_prealloc(r, tokens)
        pages = {t: f() for t, f in dsv4_state_payloads(mem.kv, mem.req_pool, r, tokens).items()}
        return cls(mem, pages, torch.zeros(staged_bytes(mem.kv, pages), dtype=torch.uint8))

    def buffers(self) -> list[tuple[StateType, list[torch.Tensor]]]:
        groups = self.mem.kv.buffers_by_type()
        return [(c.state_type, groups[c.state_type]) for c in self.mem.kv.pd_state_components()]

    @functools.cached_property
    def page_rows(self) -> list[tuple[StateType, torch.Tensor, torch.Tensor]]:
        """(type, buffer as [pages, 8-byte words], the request's page ids) per buffer, in plan order."""
        out = []
        for t, bufs in self.buffers():
            idx = torch.tensor([x for x in self.pages.get(t, []) if x], dtype=torch.int64)
            out += [(t, _words(b), idx) for b in bufs]
        return out

    def regions(self) -> tuple[list[int], list[int]]:
        comps = self.mem.kv.pd_state_components()
        ptrs = [p for c in comps for p in c.data_ptrs] + [self.staging.data_ptr()]
        return ptrs, [n for c in comps for n in c.data_lens] + [self.staging.nbytes]

    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for _, rows, idx in self.page_rows:
            for k in idx.tolist():
                h.update(rows[k].numpy())
        return h.hexdigest()

    def reset(self) -> None:
        for _, rows, idx in self.page_rows:
            rows[idx] = 0
        self.staging.zero_()

    def gather(self) -> None:
        """Pack the request's pages as a prefill server does (one segment per state type)."""
        stage_segments(self.mem.kv, list(self.pages.items()), self.staging, gather_pages)

    def scatter(self) -> None:
        """Unpack them as a decode server does."""
        stage_segments(self.mem.kv, list(self.pages.items()), self.staging, scatter_pages)

    def stage_entries(self, peer_stage_ptr: int) -> Entries:
        """The packed pages as one entry, as a server writes them."""
        return Entries.one(self.staging.data_ptr(), peer_stage_ptr, self.staging.nbytes)


# ---- the decode side (--serve) -----------------------------------------------------------------


def serve() -> int:
    """Answer one JSON command a line on stdin with one JSON line on stdout (see Peer)."""
    torch.set_num_threads(1)  # see measure()
    sides: dict[str, Side] = {}
    transports: list[MooncakeTransport] = []
    probes: list[torch.Tensor] = []
    for line in sys.stdin:
        cmd = json.loads(line)
        op, name = cmd["op"], cmd.get("name", "")
        reply: dict[str, Any] = {}
        if op == "setup":
            side = Side.build(cmd["config"], cmd["tokens"], "decode", cmd["fragmented"])
            transport = MooncakeTransport(HOST)
            transport.register(*side.regions())
            sides[name] = side
            transports.append(transport)
            comps = side.mem.kv.pd_state_components()
            reply = {
                "session": transport.session_id,
                "dst_ptrs": {str(c.state_type): c.data_ptrs for c in comps},
                "pages": {str(t): v for t, v in side.pages.items()},
                "stage_ptr": side.staging.data_ptr(),
            }
        elif op == "probe":  # a new peer with one small buffer: for handshake samples
            buf = torch.zeros(cmd["bytes"], dtype=torch.uint8)
            transport = MooncakeTransport(HOST)
            transport.register([buf.data_ptr()], [buf.nbytes])
            probes.append(buf)
            transports.append(transport)
            reply = {"session": transport.session_id, "ptr": buf.data_ptr()}
        elif op == "reset":
            sides[name].reset()
        elif op == "digest":
            reply = {"digest": sides[name].digest()}
        elif op == "scatter":
            t0 = time.perf_counter()
            sides[name].scatter()
            reply = {"seconds": time.perf_counter() - t0}
        print(json.dumps(reply), flush=True)
    for transport in transports:
        transport.close()
    return 0


class Peer:
    """The decode process: this script with --serve, spoken to over its stdin/stdout."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # Mooncake's glog
            text=True,
            env=env,
        )

    def ask(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"decode process exited (rc {self.proc.wait()}) on {op!r}")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ---- measurements ------------------------------------------------------------------------------


@dataclass
class Timing:
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def p90(self) -> float:
        s = sorted(self.seconds)
        return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


def once(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed(fn: Any, repeats: int) -> Timing:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return Timing(out)


def rechunk(entries: Entries, max_bytes: int) -> Entries:
    """Each entry cut into pieces of at most max_bytes (0: as is): the entry-size experiment."""
    if max_bytes <= 0:
        return entries
    out = Entries()
    for s, d, n in zip(entries.src, entries.dst, entries.lens, strict=True):
        for off in range(0, n, max_bytes):
            out.add(s + off, d + off, min(max_bytes, n - off))
    return out


@dataclass
class Case:
    name: str
    entries: int
    nbytes: int
    first: float
    steady: Timing


class Bench:
    def __init__(self, a: argparse.Namespace, config: dict) -> None:
        self.a, self.config = a, config
        self.env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        self.peer = Peer(self.env)
        self.transport = MooncakeTransport(HOST)
        self.sides: dict[str, tuple[Side, dict[str, Any]]] = {}
        self.plans: dict[str, Entries] = {}  # the planned write of each case

    def close(self) -> None:
        self.peer.close()
        self.transport.close()

    def setup(self, name: str, fragmented: bool) -> tuple[Side, dict[str, Any]]:
        side = Side.build(self.config, self.a.tokens, "prefill", fragmented)
        g = torch.Generator().manual_seed(len(self.sides))
        for _, bufs in side.buffers():
            for b in bufs:
                b.copy_(torch.randn(b.shape, generator=g))
        self.transport.register(*side.regions())
        info = self.peer.ask(
            "setup", name=name, config=self.config, tokens=self.a.tokens, fragmented=fragmented
        )
        self.sides[name] = (side, info)
        return side, info

    def check(self, name: str) -> None:
        side, _ = self.sides[name]
        theirs = self.peer.ask("digest", name=name)["digest"]
        if theirs != side.digest():
            raise SystemExit(f"{name}: transferred pages differ between the two sides (digest {theirs})")

    def direct(self, name: str, fragmented: bool) -> Case:
        side, info = self.setup(name, fragmented)
        comps = side.mem.kv.pd_state_components()
        dst_ptrs = {StateType(t): v for t, v in info["dst_ptrs"].items()}
        dst_pages = {StateType(t): v for t, v in info["pages"].items()}
        entries = self.plans[name] = plan_writes(comps, dst_ptrs, side.pages, dst_pages)

        def write() -> None:
            self.transport.write(info["session"], entries, self.a.max_entries)

        self.peer.ask("reset", name=name)
        first = once(write)  # opens the segment and the lanes: the handshake
        self.check(name)
        for _ in range(WARMUP):
            write()
        self.peer.ask("reset", name=name)
        steady = timed(write, self.a.repeats)
        self.check(name)
        return Case(name, len(entries), entries.nbytes, first, steady)

    def staged(self, name: str) -> tuple[Case, Timing, Timing, Timing]:
        """Gather + one entry per type + the receiver's scatter, per repeat (on `name`'s pools)."""
        side, info = self.sides[name]
        entries = side.stage_entries(info["stage_ptr"])
        gathers, writes, scatters = [], [], []
        self.peer.ask("reset", name=name)
        for _ in range(self.a.repeats):
            gathers.append(once(side.gather))
            writes.append(once(lambda: self.transport.write(info["session"], entries)))
            scatters.append(self.peer.ask("scatter", name=name)["seconds"])
        self.check(name)
        total = Timing([g + w + s for g, w, s in zip(gathers, writes, scatters, strict=True)])
        case = Case(f"{name}, staged", len(entries), entries.nbytes, float("nan"), total)
        return case, Timing(gathers), Timing(writes), Timing(scatters)

    def one_entry(self, name: str) -> Timing:
        """The same bytes as one entry, staging buffer to staging buffer: what Mooncake's TCP transport
        delivers at best for this size, whatever the plan (the ceiling of every case above)."""
        side, info = self.sides[name]
        one = Entries.one(side.staging.data_ptr(), info["stage_ptr"], side.staging.nbytes)
        self.transport.write(info["session"], one)
        return timed(lambda: self.transport.write(info["session"], one), self.a.repeats)

    def handshakes(self, samples: int) -> tuple[Timing, Timing]:
        """First and second 64-byte write to each of `samples` new peers."""
        src = torch.ones(64, dtype=torch.uint8)
        self.transport.register([src.data_ptr()], [64])
        firsts, seconds = [], []
        for i in range(samples):
            info = self.peer.ask("probe", name=f"probe{i}", bytes=64)
            one = Entries.one(src.data_ptr(), info["ptr"], 64)

            def write(s: str = info["session"], one: Entries = one) -> None:
                self.transport.write(s, one)

            firsts.append(once(write))
            seconds.append(once(write))
        return Timing(firsts), Timing(seconds)


def memcpy(nbytes: int, repeats: int) -> Timing:
    src, dst = torch.randint(0, 255, (nbytes,), dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    return timed(lambda: dst.copy_(src), repeats)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def iperf3_once(nbytes: int) -> float:
    """Seconds for nbytes at the rate iperf3 reports over one loopback TCP stream (a one-off server).

    The sender's figure: for a few MiB the receiver's stops counting before all the data has arrived
    (iperf3 3.12 counts 128 KiB of 1.2 MB), so the sender's, which ends when the last byte is in the
    socket, is the one that holds up; an upper bound on what a stream delivers.
    """
    port = str(_free_port())
    server = subprocess.Popen(
        ["iperf3", "-s", "-1", "-B", HOST, "-p", port, "--forceflush"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout
        for line in server.stdout:  # wait until it listens
            if "listening" in line:
                break
        out = subprocess.run(
            ["iperf3", "-c", HOST, "-p", port, "-n", str(nbytes), "-J"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    finally:
        server.wait(timeout=60)
    return nbytes * 8 / json.loads(out)["end"]["sum_sent"]["bits_per_second"]


def iperf3(nbytes: int, repeats: int) -> Timing | None:
    if shutil.which("iperf3") is None:
        return None
    return Timing([iperf3_once(nbytes) for _ in range(repeats)])


# ---- prefill -----------------------------------------------------------------------------------


def default_model(preset: str) -> Path:
    root = Path(os.environ.get("DSV4_CACHE", Path.home() / ".cache" / "dsv4"))
    path = root / "models" / preset
    if not (path / "config.json").exists():
        from dsv4_engine.make_tiny import make_tiny

        print(f"writing the {preset} preset to {path} (once)")
        make_tiny(path, seed=0, preset=preset)
    return path


def prefill_seconds(model: Path, tokens: int) -> float:
    """LLMEngine prefill of one `tokens`-token prompt with max_tokens=1 (after a short warm-up)."""
    from dsv4_engine.engine import LLMEngine
    from dsv4_engine.sampling_params import SamplingParams

    # Token ids only, so no tokenizer (and no transformers import).
    engine = LLMEngine(
        model, dtype="float32", device="cpu", max_model_len=tokens + 128, max_num_seqs=2, tokenizer=object()
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(0)

    def run(n: int) -> None:
        engine.add_request(torch.randint(3, engine.config.vocab_size, (n,), generator=g).tolist(), params)
        while engine.has_unfinished():
            engine.step()

    run(min(tokens, 256))
    return once(lambda: run(tokens))


# ---- report ------------------------------------------------------------------------------------


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def verdict(ratio: float, target: float) -> str:
    if ratio != ratio:  # nan: no iperf3
        return f">= {target:.0%} n/a"
    return f">= {target:.0%} {'PASS' if ratio >= target else 'MISS'}"


def report(a: argparse.Namespace, r: dict[str, Any]) -> None:
    fresh, frag, staged = r["fresh"], r["fragmented"], r["staged"]
    nbytes, mc = fresh.nbytes, r["memcpy"]
    ip = r["iperf3"]
    ip_gbps = gbps(nbytes, ip.median) if ip else float("nan")
    print(
        f"\npd_transfer: {a.preset_name}, one {a.tokens}-token request: {nbytes / 2**20:.2f} MiB of KV and "
        f"state; Mooncake TCP on {HOST} between two processes ({r['env']}, {a.max_entries} entries per "
        f"call); {a.repeats} repeats, median "
        f"(p90); load average {r['load'][0]:.2f} / {os.getloadavg()[0]:.2f} (start / end), "
        f"{os.cpu_count()} CPUs; pages checked byte for byte on both sides in every case\n"
    )
    print("| measure | value | reference | ratio | target |")
    print("|---|---:|---:|---:|---:|")
    print(f"| memcpy, same bytes (torch copy, in-process) | {gbps(nbytes, mc.median):.2f} GB/s | | 1.00x | |")
    if ip:
        ratio = ip_gbps / gbps(nbytes, mc.median)
        print(
            f"| iperf3 -n {nbytes} on {HOST}, one stream (sender's rate) | {ip_gbps:.2f} GB/s | memcpy | "
            f"{ratio:.2f}x | |"
        )
    for case in (fresh, frag):
        value = f"{gbps(nbytes, case.steady.median):.2f} GB/s, {ms(case.steady.median)} "
        value += f"({ms(case.steady.p90)})"
        ratio = gbps(nbytes, case.steady.median) / ip_gbps
        picked = not stage_pays(case.entries, nbytes)  # the server writes these pages this way
        target = verdict(ratio, TARGETS[case.name]) if picked else "(the server stages these)"
        print(
            f"| {case.name} pools, direct: {case.entries} entries | {value} | iperf3 {ip_gbps:.2f} GB/s | "
            f"{ratio:.0%} | {target} |"
        )
    one = r["one_entry"]
    ratio = gbps(nbytes, one.median) / ip_gbps
    print(
        f"| ceiling: the same bytes as one entry | {gbps(nbytes, one.median):.2f} GB/s, {ms(one.median)} "
        f"({ms(one.p90)}) | iperf3 {ip_gbps:.2f} GB/s | {ratio:.0%} | |"
    )
    g, w, s = r["stage_parts"]
    ratio = gbps(nbytes, staged.steady.median) / ip_gbps
    target = verdict(ratio, TARGETS["fragmented"]) if stage_pays(frag.entries, nbytes) else ""
    print(
        f"| fragmented pools, staged (the server's path): pack {ms(g.median)} + {staged.entries} entry "
        f"{ms(w.median)} + unpack {ms(s.median)} | {gbps(nbytes, staged.steady.median):.2f} GB/s, "
        f"{ms(staged.steady.median)} ({ms(staged.steady.p90)}) | iperf3 {ip_gbps:.2f} GB/s | {ratio:.0%} | "
        f"{target} |"
    )
    print(
        f"| staged against direct, fragmented pools | {ms(staged.steady.median)} | {frag.entries} entries: "
        f"{ms(frag.steady.median)} | {frag.steady.median / staged.steady.median:.2f}x | |"
    )
    first, second = r["handshake"]
    print(
        f"| handshake: first 64 B write to a new peer ({len(first.seconds)} peers) | {ms(first.median)} "
        f"({ms(first.p90)}) | next write to it: {ms(second.median)} | {first.median / second.median:.1f}x | |"
    )
    for case in (fresh, frag):
        print(
            f"| first write of the request, {case.name} (handshake + payload) | {ms(case.first)} | "
            f"steady: {ms(case.steady.median)} | {case.first / case.steady.median:.1f}x | |"
        )
    if r.get("prefill"):
        for case in (fresh, frag, staged):
            print(
                f"| per-request transfer, {case.name} | {ms(case.steady.median)} | prefill of the same "
                f"request (max_tokens=1): {r['prefill']:.2f} s | {case.steady.median / r['prefill']:.2%} | |"
            )


def measure(a: argparse.Namespace, config: dict) -> dict[str, Any]:
    r: dict[str, Any] = {
        "load": os.getloadavg(),
        "env": ", ".join(f"{k}={v}" for k, v in apply_env_defaults().items()),
    }
    # One torch thread a side while transferring: the two processes share this machine's cores, and
    # OpenMP workers spinning after a gather or scatter would steal the other side's Mooncake threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    bench = Bench(a, config)
    try:
        r["fresh"] = bench.direct("fresh", fragmented=False)
        r["fragmented"] = bench.direct("fragmented", fragmented=True)
        r["staged"], *parts = bench.staged("fragmented")
        r["stage_parts"] = parts
        r["one_entry"] = bench.one_entry("fragmented")
        r["handshake"] = bench.handshakes(min(a.repeats, 5))
        if a.sweep:
            r["sweep"] = sweep(bench, a.sweep)
    finally:
        bench.close()
        torch.set_num_threads(threads)
    return r


SWEEP_LANES = (1, 4, 16)


def sweep_writes(bench: Bench) -> dict[str, tuple[str, Entries, int]]:
    """(peer session, entries, entries per call) of each write setting the sweep compares."""
    fresh_session, fresh = bench.sides["fresh"][1]["session"], bench.plans["fresh"]
    side, info = bench.sides["fragmented"]
    frag = bench.plans["fragmented"]
    return {
        "fresh: merged runs": (fresh_session, fresh, DEFAULT_MAX_ENTRIES),
        "fresh: runs cut to <= 64 KiB": (fresh_session, rechunk(fresh, 64 << 10), DEFAULT_MAX_ENTRIES),
        f"fragmented: {DEFAULT_MAX_ENTRIES} entries per call": (info["session"], frag, DEFAULT_MAX_ENTRIES),
        "fragmented: 64 entries per call": (info["session"], frag, 64),
        "staged write alone": (info["session"], side.stage_entries(info["stage_ptr"]), DEFAULT_MAX_ENTRIES),
    }


def _transport_with_lanes(lanes: int) -> MooncakeTransport:
    saved = os.environ.get("MC_TCP_LANES_PER_PEER")
    os.environ["MC_TCP_LANES_PER_PEER"] = str(lanes)
    try:
        return MooncakeTransport(HOST)
    finally:
        if saved is None:
            del os.environ["MC_TCP_LANES_PER_PEER"]
        else:
            os.environ["MC_TCP_LANES_PER_PEER"] = saved


def sweep(bench: Bench, rounds: int) -> tuple[dict[str, dict[int, Timing]], dict[str, int]]:
    """Each write setting under each MC_TCP_LANES_PER_PEER, interleaved round by round (the machine's
    load drifts; settings measured minutes apart are not comparable). Lanes are read when a transport
    is created, so each count gets its own sender transport with the same regions registered."""
    writes = sweep_writes(bench)
    for name in ("fresh", "fragmented"):
        bench.peer.ask("reset", name=name)
    senders = {lanes: _transport_with_lanes(lanes) for lanes in SWEEP_LANES}
    for t in senders.values():
        for name in ("fresh", "fragmented"):
            t.register(*bench.sides[name][0].regions())
    out: dict[str, dict[int, list[float]]] = {w: {n: [] for n in senders} for w in writes}
    try:
        for i in range(rounds + 1):  # round 0 opens the connections and is dropped
            for w, (session, entries, max_entries) in writes.items():
                for lanes, t in senders.items():
                    dt = once(lambda t=t, s=session, e=entries, m=max_entries: t.write(s, e, m))
                    if i:
                        out[w][lanes].append(dt)
    finally:
        for t in senders.values():
            t.close()
    for name in ("fresh", "fragmented"):
        bench.check(name)
    timings = {w: {n: Timing(v) for n, v in d.items()} for w, d in out.items()}
    return timings, {w: len(e) for w, (_, e, _) in writes.items()}


def sweep_report(rows: dict[str, dict[int, Timing]], entries: dict[str, int], nbytes: int) -> None:
    head = " | ".join(f"{n} lanes" for n in SWEEP_LANES)
    print(f"\ntuning: GB/s (median ms), every setting interleaved round by round\n\n| write | {head} |")
    print("|---|" + "---:|" * len(SWEEP_LANES))
    for w, by_lanes in rows.items():
        cells = " | ".join(f"{gbps(nbytes, t.median):.2f} ({t.median * 1e3:.2f})" for t in by_lanes.values())
        print(f"| {w} ({entries[w]} entries) | {cells} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="make_tiny preset for the layout and the checkpoint")
    p.add_argument("--model", type=Path, help="checkpoint folder (default: the preset, made once)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--max-entries", type=int, default=DEFAULT_MAX_ENTRIES, help="entries per Mooncake call")
    p.add_argument("--no-prefill", action="store_true", help="skip the LLMEngine prefill reference")
    p.add_argument("--sweep", type=int, default=0, metavar="ROUNDS", help="also the tuning table")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the decode process
    a = p.parse_args(argv)
    if a.serve:
        return serve()
    model = a.model or (None if a.no_prefill else default_model(a.preset))
    if model is not None:
        config = json.loads((model / "config.json").read_text())
        a.preset_name = model.name
    else:
        from dsv4_engine.make_tiny import build_config

        config, a.preset_name = build_config(a.preset), f"{a.preset} preset"
    r = measure(a, config)
    r["memcpy"] = memcpy(r["fresh"].nbytes, a.repeats)
    r["iperf3"] = iperf3(r["fresh"].nbytes, a.repeats)
    if model is not None and not a.no_prefill:
        r["prefill"] = prefill_seconds(model, a.tokens)
    report(a, r)
    if r["iperf3"] is None:
        print("\niperf3 is not installed (scripts/setup.sh installs it): no network reference")
    if a.sweep:
        sweep_report(*r["sweep"], r["fresh"].nbytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
