"""One process of `dsv4 up`: started in its own process group, pinned to its cores, told to drain
if `dsv4 up` dies; its state read from its HTTP probe; its log's last lines for a report."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROBE_TIMEOUT_SECONDS = 2.0
TAIL_LINES = 30
PR_SET_PDEATHSIG = 1
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def load_libc() -> Any:
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
