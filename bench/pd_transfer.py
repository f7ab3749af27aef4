"""PD transfer of one request's paged KV and state over Mooncake (TCP, two processes on 127.0.0.1), one run.

    python bench/pd_transfer.py                       # small preset, one 4096-token request, 20 repeats
    python bench/pd_transfer.py --preset tiny --tokens 512 --repeats 3 --no-prefill   # quick
    python bench/pd_transfer.py --sweep 30            # also the tuning table: lanes x entries per call x size

This process is the prefill side; it starts the decode side (this script with --serve) as a second
process. Both build the same paged pools (fp32 on CPU, as the engine uses) and place the request the
same way a PD pair would: prefill by chunked prefill, decode by pre-allocation. Page layouts:
- fresh pools: page ids contiguous, so each state type merges into one entry per buffer;
- fragmented: two other requests grown page by page in turn and one freed before the request arrives,
  on both sides with different offsets, so no two consecutive pages merge (the worst case);
- source contiguous / destination contiguous: fresh pools on one side, fragmented on the other.
On each, every write path a server has (disagg/transfer.py PATHS), as disagg/prefill.py runs it:
direct (an entry per run of pages contiguous on both sides); staged (pack into one registered buffer
with `protocol.stage_segments` and the `kernels/pages.cpp` copy, one entry, the receiver's unpack,
both costs included); pack_only (packed, then an entry per run of the receiver's pages); unpack_only
(an entry per run of the sender's pages into the receiver's buffer, then its unpack); and the packing
paths pipelined (`MooncakeTransport.write_pipelined`: cut into pieces, each packed while the one
before is on the wire). All cases run round by round, interleaved (the machine's load drifts). The
path `transfer.choose_write` picks for each layout is marked, and its cost model is set against the
constants this run measured and against each case's time. Also:
- ceiling: the same bytes as one entry between two registered buffers, the best Mooncake's TCP
  transport does for this size whatever the plan;
against memcpy of the same bytes (a torch copy in-process) and `iperf3 -n <same bytes>` on loopback
(its sender's rate; see iperf3_once), the issue's reference and the one the targets are judged
against; and a second, fairer one: a plain TCP socket moving the same bytes between the same two
buffers as the ceiling (two processes, one connection, each message acknowledged once it has landed),
measured round by round with the ceiling. iperf3 sends and receives one cache-hot 128 KiB buffer over
and over, a write must read and fill megabytes of distinct memory; the plain socket pays that too. Both sides use one torch thread while transferring (they share
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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

from dsv4_engine.disagg.mooncake import DEFAULT_MAX_ENTRIES, MooncakeTransport, apply_env_defaults
from dsv4_engine.disagg.protocol import stage_segments, staged_bytes
from dsv4_engine.disagg.transfer import (
    COSTS,
    PACKING,
    PIECES,
    UNPACKING,
    Costs,
    Entries,
    WriteShape,
    choose_write,
    path_label,
    plan_packed,
    plan_writes,
    split_pieces,
    write_seconds,
    write_shape,
)
from dsv4_engine.memory import Dsv4MemoryLayout, ExtendSpec, PagedMemory, StateType, dsv4_state_payloads
from dsv4_engine.memory.sizing import fixed_pool_sizes
from dsv4_engine.memory.staging import gather_pages, scatter_pages
from dsv4_engine.memory.state_tail import cdiv

HOST = "127.0.0.1"
WARMUP = 3  # untimed writes after the first: the next few are still slow (tiny preset: 2 ms, then 0.55)
TARGETS = {"fresh": 0.70, "fragmented": 0.50}  # of iperf3's bytes/s (one-sided layouts: fragmented's)


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

    def scatter(self, pieces: list[list[Any]] | None = None) -> None:
        """Unpack them as a decode server does: the (type, lo, hi) segments the prefill sent (default
        one per state type)."""
        segments = (
            list(self.pages.items())
            if pieces is None
            else [(StateType(t), self.pages[StateType(t)][lo:hi]) for t, lo, hi in pieces]
        )
        stage_segments(self.mem.kv, segments, self.staging, scatter_pages)

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
        elif op == "socket":  # the plain-TCP reference's receiving end
            listener = socket.create_server((HOST, 0))
            threading.Thread(target=_sink, args=(listener, cmd["bytes"]), daemon=True).start()
            reply = {"port": listener.getsockname()[1]}
        elif op == "reset":
            sides[name].reset()
        elif op == "digest":
            reply = {"digest": sides[name].digest()}
        elif op == "scatter":
            t0 = time.perf_counter()
            sides[name].scatter(cmd.get("pieces"))
            reply = {"seconds": time.perf_counter() - t0}
        print(json.dumps(reply), flush=True)
    for transport in transports:
        transport.close()
    return 0


def _sink(listener: socket.socket, nbytes: int) -> None:
    """One connection: each 8-byte length is followed by that many bytes, received into one buffer of
    `nbytes` (as a write fills the decode's memory), then acknowledged with a byte."""
    conn, _ = listener.accept()
    listener.close()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    into = memoryview(torch.zeros(nbytes, dtype=torch.uint8).numpy())
    with conn:
        while header := conn.recv(8, socket.MSG_WAITALL):
            n, got = int.from_bytes(header, "little"), 0
            while got < n:
                got += conn.recv_into(into[got:n], n - got)
            conn.sendall(b"k")


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
    path: str = "direct"  # transfer.path_label
    pieces: int = 1  # what the write was cut into
    asked: set[int] = field(default_factory=lambda: {1})  # the pieces asked for (fewer pages: fewer)
    parts: dict[str, Timing] = field(default_factory=dict)  # pack / write / unpack, where separable

    @property
    def base(self) -> str:
        """The path without its pipelining (transfer.PATHS)."""
        return self.path.removesuffix("_pipelined")


# Page layouts of the one request, by (prefill's pages scattered, decode's pages scattered).
LAYOUTS = {
    "fresh": (False, False),
    "fragmented": (True, True),
    "source contiguous": (False, True),
    "destination contiguous": (True, False),
}
# The paths measured on each layout besides direct: every path whose entries that layout changes.
LAYOUT_PATHS: dict[str, list[tuple[str, int]]] = {
    "fresh": [],
    "fragmented": [("staged", 1), ("staged", 2), ("staged", 4)],
    "source contiguous": [("unpack_only", 1), ("staged", 1), ("staged", 4)],
    "destination contiguous": [
        ("pack_only", 1),
        ("pack_only", 2),
        ("pack_only", 4),
        ("staged", 1),
        ("staged", 4),
    ],
}


class Bench:
    def __init__(self, a: argparse.Namespace, config: dict) -> None:
        self.a, self.config = a, config
        self.env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        self.peer = Peer(self.env)
        self.transport = MooncakeTransport(HOST)
        self.sides: dict[str, tuple[Side, dict[str, Any]]] = {}
        self.plans: dict[str, Entries] = {}  # the planned direct write of each layout
        self.firsts: dict[str, float] = {}  # its first write's seconds

    def close(self) -> None:
        self.peer.close()
        self.transport.close()

    def setup(self, name: str) -> tuple[Side, dict[str, Any]]:
        src_scattered, dst_scattered = LAYOUTS[name]
        side = Side.build(self.config, self.a.tokens, "prefill", src_scattered)
        g = torch.Generator().manual_seed(len(self.sides))
        for _, bufs in side.buffers():
            for b in bufs:
                b.copy_(torch.randn(b.shape, generator=g))
        self.transport.register(*side.regions())
        info = self.peer.ask(
            "setup", name=name, config=self.config, tokens=self.a.tokens, fragmented=dst_scattered
        )
        info["dst_ptrs"] = {StateType(t): v for t, v in info["dst_ptrs"].items()}
        info["pages"] = {StateType(t): v for t, v in info["pages"].items()}
        self.sides[name] = (side, info)
        return side, info

    def check(self, name: str) -> None:
        side, _ = self.sides[name]
        theirs = self.peer.ask("digest", name=name)["digest"]
        if theirs != side.digest():
            raise SystemExit(f"{name}: transferred pages differ between the two sides (digest {theirs})")

    def shape(self, name: str) -> WriteShape:
        """What the server's cost model sees of this layout's write."""
        side, info = self.sides[name]
        comps = side.mem.kv.pd_state_components()
        return write_shape(comps, side.pages, info["pages"], len(self.plans[name]))

    def direct(self, name: str) -> None:
        """Set `name`'s layout up on both sides and plan its direct write; its first write (the
        handshake: it opens the segment and the lanes) is timed apart."""
        side, info = self.setup(name)
        comps = side.mem.kv.pd_state_components()
        entries = self.plans[name] = plan_writes(comps, info["dst_ptrs"], side.pages, info["pages"])
        self.peer.ask("reset", name=name)
        self.firsts[name] = once(lambda: self.transport.write(info["session"], entries, self.a.max_entries))
        self.check(name)

    def steps(self, name: str, path: str, pieces: int) -> tuple[list[tuple[Any, Entries]], list[list[Any]]]:
        """What a prefill server's worker does for this path: (pack, entries) per piece, as
        disagg/prefill.py plans them, and the (type, lo, hi) segments the decode then unpacks."""
        side, info = self.sides[name]
        kv, comps = side.mem.kv, side.mem.kv.pd_state_components()
        page_bytes = {c.state_type: sum(c.item_lens) for c in comps}
        parts = split_pieces([(t, 0, v) for t, v in side.pages.items()], page_bytes, pieces)
        src_ptrs = {c.state_type: c.data_ptrs for c in comps}
        steps, at = [], 0
        for piece in parts:
            src = [(t, side.pages[t][lo:hi]) for t, lo, hi in piece]
            n = staged_bytes(kv, dict(src))
            here, there = side.staging.data_ptr() + at, info["stage_ptr"] + at
            if path == "unpack_only":
                steps.append((lambda: None, plan_packed(comps, src_ptrs, src, there, into_packed=True)))
            else:
                if path == "staged":
                    entries = Entries.one(here, there, n)
                else:
                    dst = [(t, info["pages"][t][lo:hi]) for t, lo, hi in piece]
                    entries = plan_packed(comps, info["dst_ptrs"], dst, here, into_packed=False)
                pack = functools.partial(stage_segments, kv, src, side.staging[at : at + n], gather_pages)
                steps.append((pack, entries))
            at += n
        return steps, [[str(t), lo, hi] for piece in parts for t, lo, hi in piece]

    def runner(self, name: str, path: str, pieces: int) -> tuple[Any, int, int]:
        """(one, pieces, entries): one() writes `name`'s pages once on `path`, the receiver's unpack
        included, and returns the seconds of each part (pack and write apart unless pipelined:
        then they overlap and count as the write)."""
        _, info = self.sides[name]
        if path == "direct":
            steps, segments = [(None, self.plans[name])], []
        else:
            steps, segments = self.steps(name, path, pieces)

        def one() -> dict[str, float]:
            out = {}
            if len(steps) > 1:
                out["write"] = once(lambda: self.transport.write_pipelined(info["session"], steps))
            else:
                if path in PACKING:
                    out["pack"] = once(steps[0][0])
                out["write"] = once(
                    lambda: self.transport.write(info["session"], steps[0][1], self.a.max_entries)
                )
            if path in UNPACKING:
                out["unpack"] = self.peer.ask("scatter", name=name, pieces=segments)["seconds"]
            return out

        return one, len(steps), sum(len(e) for _, e in steps)

    def paths(self) -> dict[str, list[Case]]:
        """Every layout's direct write and each path LAYOUT_PATHS lists for it, round by round (the
        machine's load drifts: cases measured seconds apart are not comparable); each case's first
        run is checked byte for byte on its own, then untimed with the next few. A request with
        fewer pages than pieces is cut into fewer: the same case as one asked for earlier."""
        runs: dict[tuple[str, str, int], tuple[Any, int, int]] = {}
        asked: dict[tuple[str, str, int], set[int]] = {}
        for name in LAYOUTS:
            for path, pieces in [("direct", 1), *LAYOUT_PATHS[name]]:
                one, cut, entries = self.runner(name, path, pieces)
                key = (name, path, cut)
                asked.setdefault(key, set()).add(pieces)
                runs.setdefault(key, (one, cut, entries))
        samples: dict[tuple[str, str, int], list[dict[str, float]]] = {key: [] for key in runs}
        for i in range(WARMUP + self.a.repeats):
            for key, (one, _, _) in runs.items():
                if i == 0:
                    self.peer.ask("reset", name=key[0])
                out = one()
                if i == 0:
                    self.check(key[0])
                if i >= WARMUP:
                    samples[key].append(out)
        cases: dict[str, list[Case]] = {name: [] for name in LAYOUTS}
        for (name, path, cut), (_, _, entries) in runs.items():
            parts = {
                k: Timing([s[k] for s in samples[(name, path, cut)]]) for k in samples[(name, path, cut)][0]
            }
            total = Timing([sum(s.values()) for s in samples[(name, path, cut)]])
            label = path_label(path, cut)
            first = self.firsts.get(name, float("nan")) if path == "direct" else float("nan")
            cases[name].append(Case(f"{name}, {label}", entries, self.sides[name][0].staging.nbytes, first,
                                    total, label, cut, asked[(name, path, cut)], parts))  # fmt: skip
        return cases

    def piece_overhead(self, name: str, pieces: int) -> float:
        """Seconds each piece past the first adds: the same bytes as one entry, then as `pieces`
        entries submitted one after another without packing (write_pipelined), round by round;
        the median of the rounds' differences (3x --repeats rounds: the difference is small)."""
        side, info = self.sides[name]
        n, base, there = side.staging.nbytes, side.staging.data_ptr(), info["stage_ptr"]
        cut = -(-n // pieces)
        steps = [(lambda: None, Entries.one(base + i, there + i, min(cut, n - i))) for i in range(0, n, cut)]
        one = Entries.one(base, there, n)
        diffs = [once(lambda: self.transport.write_pipelined(info["session"], steps))
                 - once(lambda: self.transport.write(info["session"], one))
                 for _ in range(3 * self.a.repeats)]  # fmt: skip
        return statistics.median(diffs) / (len(steps) - 1)

    def one_entry(self, name: str) -> tuple[Timing, Timing]:
        """The same bytes as one entry, staging buffer to staging buffer: what Mooncake's TCP transport
        delivers at best for this size, whatever the plan (the ceiling of every case above); and,
        round by round with it, the same bytes over a plain TCP socket from the same buffer into one
        as large in the decode process (the fair reference: see the docstring)."""
        side, info = self.sides[name]
        one = Entries.one(side.staging.data_ptr(), info["stage_ptr"], side.staging.nbytes)
        n = side.staging.nbytes
        port = self.peer.ask("socket", bytes=n)["port"]
        data = memoryview(side.staging.numpy())
        with socket.create_connection((HOST, port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def plain() -> None:
                conn.sendall(n.to_bytes(8, "little"))
                conn.sendall(data)
                if conn.recv(1) != b"k":
                    raise RuntimeError("the plain-socket reference's receiver went away")

            mooncake, sock = [], []
            for i in range(WARMUP + self.a.repeats):
                dt = (once(lambda: self.transport.write(info["session"], one)), once(plain))
                if i >= WARMUP:
                    mooncake.append(dt[0])
                    sock.append(dt[1])
        return Timing(mooncake), Timing(sock)

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
    direct, paths = r["direct"], r["paths"]
    nbytes, mc = direct["fresh"].nbytes, r["memcpy"]
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
    for layout, case in direct.items():
        for c in [case, *paths[layout]]:
            print(case_row(layout, c, chosen(r, layout), ip_gbps))
    one, sock = r["one_entry"], r["socket"]
    ratio = gbps(nbytes, one.median) / ip_gbps
    print(
        f"| ceiling: the same bytes as one entry | {gbps(nbytes, one.median):.2f} GB/s, {ms(one.median)} "
        f"({ms(one.p90)}) | iperf3 {ip_gbps:.2f} GB/s | {ratio:.0%} | |"
    )
    sock_gbps = gbps(nbytes, sock.median)
    print(
        f"| second reference: a plain TCP socket, the same bytes buffer to buffer between the two processes "
        f"(acknowledged; round by round with the ceiling) | {sock_gbps:.2f} GB/s, {ms(sock.median)} "
        f"({ms(sock.p90)}) | iperf3 {ip_gbps:.2f} GB/s | {sock_gbps / ip_gbps:.0%} | |"
    )
    for what, case in (("ceiling (one entry)", None), *((f"{k} pools, the server's path", chosen(r, k))
                                                       for k in ("fresh", "fragmented"))):  # fmt: skip
        t = one if case is None else case.steady
        print(
            f"| against the plain socket: {what} | {gbps(nbytes, t.median):.2f} GB/s | plain socket "
            f"{sock_gbps:.2f} GB/s | {gbps(nbytes, t.median) / sock_gbps:.0%} | |"
        )
    for layout, case in direct.items():
        server = chosen(r, layout)
        if server is not case:
            print(
                f"| {layout} pools: the server's path ({server.path}) against direct | "
                f"{ms(server.steady.median)} | {case.entries} entries: {ms(case.steady.median)} | "
                f"{case.steady.median / server.steady.median:.2f}x | |"
            )
    first, second = r["handshake"]
    print(
        f"| handshake: first 64 B write to a new peer ({len(first.seconds)} peers) | {ms(first.median)} "
        f"({ms(first.p90)}) | next write to it: {ms(second.median)} | {first.median / second.median:.1f}x | |"
    )
    for name in ("fresh", "fragmented"):
        case = direct[name]
        print(
            f"| first write of the request, {name} (handshake + payload) | {ms(case.first)} | "
            f"steady: {ms(case.steady.median)} | {case.first / case.steady.median:.1f}x | |"
        )
    if r.get("prefill"):
        for layout in direct:
            case = chosen(r, layout)
            print(
                f"| per-request transfer, {layout} ({case.path}) | {ms(case.steady.median)} | prefill of the "
                f"same request (max_tokens=1): {r['prefill']:.2f} s | {case.steady.median / r['prefill']:.2%} | |"
            )
    model_report(r)


def chosen(r: dict[str, Any], layout: str) -> Case:
    """The measured case of the path the server's cost model picks for this layout."""
    path, pieces = r["picks"][layout]
    cases = [r["direct"][layout], *r["paths"][layout]]
    return next(c for c in cases if c.base == path and pieces in c.asked)


def case_row(layout: str, case: Case, picked: Case, ip_gbps: float) -> str:
    nbytes, t = case.nbytes, case.steady
    ratio = gbps(nbytes, t.median) / ip_gbps
    mine = case is picked
    target = TARGETS.get(layout, TARGETS["fragmented"])
    taken = f"{picked.path}" + (f" in {picked.pieces} pieces" if picked.pieces > 1 else "")
    verdict_cell = verdict(ratio, target) if mine else f"(the server takes {taken})"
    entries = plural(case.entries, "entry")
    if case.pieces > 1:
        entries += f" in {case.pieces} pieces, packed while on the wire,"
    what = " + ".join(f"{k} {ms(v.median)}" if k != "write" else f"{entries} {ms(v.median)}"
                      for k, v in case.parts.items())  # fmt: skip
    path = f"{case.path} (the server's path)" if mine else case.path
    return (
        f"| {layout} pools, {path}: {what} | {gbps(nbytes, t.median):.2f} GB/s, {ms(t.median)} ({ms(t.p90)}) "
        f"| iperf3 {ip_gbps:.2f} GB/s | {ratio:.0%} | {verdict_cell} |"
    )


def plural(n: int, word: str) -> str:
    many = word[:-1] + "ies" if word.endswith("y") else word + "s"
    return f"{n} {word if n == 1 else many}"


def calibrate(r: dict[str, Any]) -> Costs:
    """The cost model's constants as this run measured them (medians)."""
    frag, one = r["direct"]["fragmented"], r["one_entry"]
    nbytes = frag.nbytes
    parts = next(c for c in r["paths"]["fragmented"] if c.path == "staged").parts
    wire = one.median / nbytes
    entry = max(frag.steady.median - one.median, 0.0) / (frag.entries - 1)
    pack, unpack = parts["pack"].median / nbytes, parts["unpack"].median / nbytes
    piece = max(r["piece"], 0.0)
    overlaps = [overlap_of(c, unpiped, piece) for cases in r["paths"].values() for c in cases
                for unpiped in cases if c.pieces > 1 and unpiped.path == c.base]  # fmt: skip
    overlap = statistics.median(overlaps) if overlaps else float("nan")
    return Costs(entry=entry, wire=wire, pack=pack, unpack=unpack, piece=piece, overlap=overlap)


def overlap_of(pipelined: Case, unpiped: Case, piece: float) -> float:
    """The overlap that makes the model's pipelined write (pack and write of `pipelined.pieces`
    pieces) take what it measured, given the same path's pack and write measured apart."""
    k = pipelined.pieces
    a, b = unpiped.parts["pack"].median / k, unpiped.parts["write"].median / k
    hidden = a + b + (k - 1) * (max(a, b) + min(a, b) + piece) - pipelined.parts["write"].median
    return min(max(hidden / ((k - 1) * min(a, b)), 0.0), 1.0)


def model_report(r: dict[str, Any]) -> None:
    """The constants this run measured against transfer.COSTS, and the model's time for every case
    (with COSTS) against the measured one: the model has to rank the paths, not time them exactly."""
    run = calibrate(r)
    print("\ncost model (disagg/transfer.py COSTS): this run's constants\n")
    print("| constant | this run | COSTS |\n|---|---:|---:|")
    units = {"entry": (1e6, "us"), "piece": (1e6, "us"), "overlap": (1.0, "")}
    for name in ("entry", "wire", "pack", "unpack", "piece", "overlap"):
        mine, theirs = getattr(run, name), getattr(COSTS, name)
        if name in units:
            scale, unit = units[name]
            print(f"| {name} | {mine * scale:.2f} {unit} | {theirs * scale:.2f} {unit} |")
        else:  # seconds per byte, shown as a rate
            print(f"| {name} | {1 / mine / 1e9:.2f} GB/s | {1 / theirs / 1e9:.2f} GB/s |")
    print("\n| layout | path | measured | model | model's pick |\n|---|---|---:|---:|---|")
    for layout, case in r["direct"].items():
        shape = r["shapes"][layout]
        for c in [case, *r["paths"][layout]]:
            mark = "yes" if c is chosen(r, layout) else ""
            print(f"| {layout} | {c.path} ({c.pieces}) | {ms(c.steady.median)} | "
                  f"{ms(write_seconds(shape, c.base, c.pieces))} | {mark} |")  # fmt: skip


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
        for name in LAYOUTS:
            bench.direct(name)
        r["shapes"] = {name: bench.shape(name) for name in LAYOUTS}
        r["picks"] = {
            name: choose_write(shape, can_pack=True, can_unpack=True) for name, shape in r["shapes"].items()
        }
        for name, pick in r["picks"].items():  # the server's pick is always among the cases
            if pick != ("direct", 1) and pick not in LAYOUT_PATHS[name]:
                LAYOUT_PATHS[name].append(pick)
        cases = bench.paths()
        r["direct"] = {name: cases[name][0] for name in LAYOUTS}
        r["paths"] = {name: cases[name][1:] for name in LAYOUTS}
        r["one_entry"], r["socket"] = bench.one_entry("fragmented")
        r["piece"] = bench.piece_overhead("fragmented", PIECES[-1])
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
    nbytes = r["direct"]["fresh"].nbytes
    r["memcpy"] = memcpy(nbytes, a.repeats)
    r["iperf3"] = iperf3(nbytes, a.repeats)
    if model is not None and not a.no_prefill:
        r["prefill"] = prefill_seconds(model, a.tokens)
    report(a, r)
    if r["iperf3"] is None:
        print("\niperf3 is not installed (scripts/setup.sh installs it): no network reference")
    if a.sweep:
        sweep_report(*r["sweep"], nbytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
