"""The cluster `dsv4 up` supervises: servers first, the router once they are healthy, one line per
state change, and a stop in order (the servers drain, then the router stops)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from dsv4_operator import local as lc
from dsv4_operator.plan import stop_seconds  # the drain's grace period and margin, as in the pods
from dsv4_operator.spec import Dsv4Deployment
from dsv4_operator.up_process import Child, load_libc, router_state, server_state

EXIT_FAILED = 1
POLL_SECONDS = 0.2  # how often process states are looked at (a supervisor's poll, not a test's sleep)
ROUTER_STOP_SECONDS = 10
# A clean stop: dsv4 serve exits 0 after draining; a process still importing dies of the signal.
CLEAN_EXITS = (0, -signal.SIGTERM)


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
        clean = self._stop_group(self.servers, max(stop_seconds(self.dep, role) for role in lc.SERVER_ROLES))
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
        libc = load_libc()
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
