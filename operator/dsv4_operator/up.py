"""`dsv4 up`: a Dsv4Deployment as a prefill/decode cluster of processes on 127.0.0.1.

    dsv4 up                         # the bundled CPU example on the bundled demo model
    dsv4 up -f dep.yaml             # any spec whose model is on this machine
    dsv4 up --ports free            # free ports instead of the spec's (offset per server)

It starts the prefill and decode servers with the arguments the operator gives their pods
(`dsv4_operator.local` names every difference), prints one line per state change while they load,
starts the router once they are healthy, and prints the endpoint when the router has its servers.
SIGINT or SIGTERM drains: the servers get SIGTERM and finish their in-flight requests, then the
router stops; the exit status is 0. A process that dies stops the rest; the exit status is 1 and
its last log lines are printed. Each process logs to <log dir>/<name>.log.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from dsv4_operator import local as lc
from dsv4_operator.spec import Dsv4Deployment, SpecError, parse

EXIT_FAILED = 1
EXIT_INVALID = 2
BUNDLED_SPEC = Path(__file__).with_name("data") / "cpu-tiny.yaml"
POLL_SECONDS = 0.2  # how often process states are looked at (a supervisor's poll, not a test's sleep)
PROBE_TIMEOUT_SECONDS = 2.0
DRAIN_MARGIN_SECONDS = 30  # beyond the grace period, as the pods' terminationGracePeriodSeconds
ROUTER_STOP_SECONDS = 10
TAIL_LINES = 30
PR_SET_PDEATHSIG = 1
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A clean stop: dsv4 serve exits 0 after draining; a process still importing dies of the signal.
CLEAN_EXITS = (0, -signal.SIGTERM)


# ---- the model -------------------------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4"


def is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file()


def resolve_model(dep: Dsv4Deployment) -> str:
    """The checkpoint directory to serve; the bundled example's model is the bundled demo checkpoint
    (dsv4_engine.demo: the tiny architecture trained to write like the Python docs)."""
    path, fieldname = lc.model_source(dep)
    if is_checkpoint(Path(path)):
        return path
    if dep.spec.model == load(BUNDLED_SPEC).spec.model:
        from dsv4_engine import demo

        try:
            return str(demo.bundled())
        except (OSError, RuntimeError) as e:  # a damaged install: say so, not a traceback
            raise lc.LocalError([(fieldname, str(e))]) from e
    hint = "dsv4 up reads the model from this machine: point spec.model.hostPath.path at a checkpoint"
    raise lc.LocalError([(fieldname, f"no checkpoint at {path} (no config.json); {hint}")])


# ---- one process -----------------------------------------------------------------------------------


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _child_setup(cpus: tuple[int, ...], libc: Any, parent: int) -> Callable[[], None]:
    def setup() -> None:  # runs in the child between fork and exec
        os.sched_setaffinity(0, cpus)  # before the child starts threads: they inherit it
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))  # dsv4 up killed outright: the child drains
        if os.getppid() != parent:
            os._exit(1)

    return setup


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    cpus: tuple[int, ...]
    url: str
    probe_path: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    state: str = "pending"

    def start(self, libc: Any) -> None:
        with self.log_path.open("wb") as log:
            # Its own process group: a terminal's Ctrl-C reaches dsv4 up only, which stops the
            # children in order (servers drain first, the router last).
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                process_group=0,
                preexec_fn=_child_setup(self.cpus, libc, os.getpid()),
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.returncode() is None:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def tail(self, lines: int = TAIL_LINES) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [ANSI.sub("", line) for line in text.splitlines()[-lines:]]


def probe(url: str) -> tuple[int | None, Any]:
    """(HTTP status, JSON body or None); (None, None) while nothing answers. Never via a proxy."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=PROBE_TIMEOUT_SECONDS) as r:
            return r.status, _json(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _json(exc.read())
    except (OSError, ValueError):
        return None, None


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def server_state(child: Child) -> str:
    """starting (nothing answers), loading, healthy, draining or dead, from `dsv4 serve`'s /health."""
    status, body = probe(child.url + child.probe_path)
    if status is None:
        return "starting"
    if status == 200:
        return "healthy"
    return body.get("status", f"http {status}") if isinstance(body, dict) else f"http {status}"


def router_state(child: Child) -> str:
    """starting, waiting for servers (its /readiness is 503 until it has them), or healthy."""
    status, _ = probe(child.url + child.probe_path)
    if status is None:
        return "starting"
    return "healthy" if status == 200 else "waiting for servers"


# ---- the cluster ---------------------------------------------------------------------------------


class Died(Exception):
    def __init__(self, child: Child, why: str) -> None:
        super().__init__(f"{child.name} {why}")
        self.child = child


class Signals:
    """SIGINT/SIGTERM: the first stops the cluster (drain), a second, while draining, stops the
    servers at once (`dsv4 serve` stops on its second signal)."""

    def __init__(self) -> None:
        self.count = 0
        self._wake = threading.Event()

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self._wake.set()

    def wait(self, seconds: float) -> None:
        if self._wake.wait(seconds):
            self._wake.clear()


class Progress:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def line(self, name: str, state: str, detail: str = "") -> None:
        tail = f"  {detail}" if detail else ""
        print(f"dsv4 up {self.elapsed():6.1f}s  {name:<10} {state}{tail}", flush=True)


def describe_exit(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


@dataclass
class Cluster:
    dep: Dsv4Deployment
    local: lc.Local
    servers: list[Child]
    router: Child
    log_dir: Path
    progress: Progress = field(default_factory=Progress)
    signals: Signals = field(default_factory=Signals)

    @property
    def children(self) -> list[Child]:
        return [*self.servers, self.router]

    def start(self, child: Child, libc: Any) -> None:
        child.start(libc)
        cpus = ",".join(map(str, child.cpus))
        self.progress.line(child.name, "starting", f"pid {child.pid}  {child.url}  cpus {cpus}")
        child.state = "starting"

    def check(self, child: Child, state_of: Callable[[Child], str] | None) -> None:
        """Raise Died if the child exited (or reports a dead engine); print its state when it changes."""
        code = child.returncode()
        if code is not None:
            raise Died(child, f"exited ({describe_exit(code)}) while {child.state}")
        if state_of is None:
            return
        state = state_of(child)
        if state == "dead":
            raise Died(child, "reports its engine dead (/health: dead)")
        if state != child.state:
            child.state = state
            self.progress.line(child.name, state)

    def wait_healthy(self, children: list[Child], state_of: Callable[[Child], str]) -> bool:
        """Until every child is healthy (True) or a signal came (False); bounded like the pods'
        startup probe."""
        deadline = time.monotonic() + self.dep.spec.probes.startup_timeout_seconds
        while not self.signals.count:
            for child in self.children:
                if child.proc is not None:
                    self.check(child, state_of if child in children else None)
            if all(c.state == "healthy" for c in children):
                return True
            if time.monotonic() > deadline:
                slow = next(c for c in children if c.state != "healthy")
                bound = self.dep.spec.probes.startup_timeout_seconds
                raise Died(slow, f"still {slow.state} after spec.probes.startupTimeoutSeconds ({bound}s)")
            self.signals.wait(POLL_SECONDS)
        return False

    def serve_until_signal(self) -> None:
        while not self.signals.count:
            for child in self.children:
                self.check(child, None)
            self.signals.wait(POLL_SECONDS)

    def announce(self) -> None:
        name = self.dep.spec.model.served_model_name
        body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello"}]})
        auth = ' -H "authorization: Bearer $DSV4_API_KEY"' if self.local.api_key else ""
        print(
            f"dsv4 up: endpoint {self.local.endpoint}  (model {name}, ready in {self.progress.elapsed():.1f}s)"
        )
        print(
            f"  curl {self.local.endpoint}/chat/completions -H 'content-type: application/json'{auth} -d '{body}'"
        )
        print(f"  logs in {self.log_dir}; Ctrl-C or `kill -TERM {os.getpid()}` drains and stops", flush=True)

    def report(self, exc: Died) -> None:
        child = exc.child
        print(f"dsv4 up: {exc}; last lines of {child.log_path}:", file=sys.stderr)
        for line in child.tail():
            print(f"  | {line}", file=sys.stderr)
        sys.stderr.flush()

    def stop(self) -> bool:
        """Servers first (SIGTERM: they drain), then the router. True if everything stopped cleanly."""
        clean = self._stop_group(
            self.servers, self.dep.spec.engine.grace_period_seconds + DRAIN_MARGIN_SECONDS
        )
        self._stop_group([self.router], ROUTER_STOP_SECONDS, judge=False)
        print("dsv4 up: stopped", flush=True)
        return clean

    def _stop_group(self, group: list[Child], bound: float, judge: bool = True) -> bool:
        running = [c for c in group if c.returncode() is None and c.proc is not None]
        if not running:
            return True
        for child in running:
            child.signal(signal.SIGTERM)
            self.progress.line(child.name, "stopping", "SIGTERM" + (": draining" if judge else ""))
        clean, seen, deadline = True, self.signals.count, time.monotonic() + bound
        while running:
            for child in list(running):
                code = child.returncode()
                if code is not None:
                    running.remove(child)
                    clean &= not judge or code in CLEAN_EXITS
                    self.progress.line(child.name, "stopped", describe_exit(code))
            if running and self.signals.count > seen:  # asked again: stop now
                seen = self.signals.count
                for child in running:
                    child.signal(signal.SIGTERM)
            if running and time.monotonic() > deadline:
                for child in running:
                    child.signal(signal.SIGKILL)
                    self.progress.line(child.name, "killed", f"not stopped within {bound:.0f}s")
                for child in running:
                    assert child.proc is not None
                    child.proc.wait()
                return False
            if running:
                self.signals.wait(POLL_SECONDS)
        return clean

    def run(self) -> int:
        libc = _libc()
        try:
            for child in self.servers:
                self.start(child, libc)
            # The router starts once its servers are healthy, as its pods' discovery adds Ready pods only
            # (started earlier, its registration retries back off while the servers load).
            if self.wait_healthy(self.servers, server_state):
                self.start(self.router, libc)
                if self.wait_healthy([self.router], router_state):
                    self.announce()
                    self.serve_until_signal()
            return 0 if self.stop() else EXIT_FAILED
        except Died as exc:
            self.report(exc)
            self.stop()
            return EXIT_FAILED
        finally:
            for child in self.children:  # whatever happened above, no child outlives dsv4 up
                if child.returncode() is None and child.proc is not None:
                    child.proc.kill()
                    child.proc.wait()


def build(dep: Dsv4Deployment, lo: lc.Local, log_dir: Path, env: Mapping[str, str]) -> Cluster:
    servers = [
        Child(
            name=s.name,
            argv=lc.server_argv(dep, lo, s),
            env=lc.server_env(dep, s, env),
            cpus=s.cpus,
            url=lo.url(s.port),
            probe_path="/health",
            log_path=log_dir / f"{s.name}.log",
        )
        for s in lo.servers
    ]
    router = Child(
        name="router",
        argv=lc.router_argv(dep, lo),
        env=lc.router_env(env),
        cpus=lo.cpus,
        url=lo.url(lo.router_port),
        probe_path="/readiness",
        log_path=log_dir / "router.log",
    )
    return Cluster(dep=dep, local=lo, servers=servers, router=router, log_dir=log_dir)


# ---- the command line ------------------------------------------------------------------------------


def load(path: Path) -> Dsv4Deployment:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    if len(docs) != 1:
        raise SpecError([("(root)", f"expected one Dsv4Deployment in the file, found {len(docs)}")])
    return parse(docs[0])


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dsv4 up",
        description="Run a Dsv4Deployment as a prefill/decode cluster of processes on 127.0.0.1.",
    )
    ap.add_argument(
        "-f", "--filename", type=Path, help="Dsv4Deployment YAML (default: the bundled CPU example)"
    )
    ap.add_argument(
        "--ports",
        choices=("spec", "free"),
        default="spec",
        help="spec: the spec's ports, offset per server (default); free: ports the kernel hands out",
    )
    ap.add_argument("--log-dir", type=Path, help="where each process logs (default: <cache>/dsv4/up/<name>)")
    return ap


def prepare(args: argparse.Namespace, env: Mapping[str, str]) -> Cluster:
    """Spec, model, ports, cores -> the cluster to start (raises SpecError naming the field)."""
    dep = load(args.filename or BUNDLED_SPEC)
    if not dep.spec.prefill.replicas:
        raise lc.LocalError([("spec.prefill.replicas", "0 (paused): there is nothing to run")])
    model = resolve_model(dep)
    ports = lc.choose_ports(dep, args.ports)
    lo = lc.local(dep, model=model, ports=ports, cpus=sorted(os.sched_getaffinity(0)), env=env)
    log_dir = args.log_dir or cache_dir() / "up" / dep.metadata.name
    log_dir.mkdir(parents=True, exist_ok=True)
    return build(dep, lo, log_dir, env)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    source = str(args.filename or BUNDLED_SPEC)
    try:
        cluster = prepare(args, os.environ)
    except SpecError as exc:
        for fieldname, reason in exc.errors:
            print(f"{source}: {fieldname}: {reason}", file=sys.stderr)
        return EXIT_INVALID
    except OSError as exc:
        print(f"{source}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    lo = cluster.local
    roles = f"{len(lo.role('prefill'))} prefill, {len(lo.role('decode'))} decode, 1 router"
    print(
        f"dsv4 up: {cluster.dep.metadata.name} from {source}: {roles} on {len(lo.cpus)} cores; model {lo.model}"
    )
    previous = {sig: signal.signal(sig, cluster.signals) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return cluster.run()
    finally:
        for sig, handler in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
