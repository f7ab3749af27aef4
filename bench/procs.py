"""The processes a benchmark starts on 127.0.0.1 (servers, routers, `dsv4 up`), shared by bench/pd.py
and bench/prefix.py: each spawned with its log, pinned to cores if asked, killed when the benchmark
dies, stopped in reverse order; readiness waited on with a bound that fails on a process exiting.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_setup(cores: tuple[int, ...] | None) -> Callable[[], None]:
    """In the child before exec: pin it, and have it killed when this process dies."""

    def setup() -> None:
        if cores is not None:
            os.sched_setaffinity(0, cores)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return setup


@dataclass
class Proc:
    name: str
    log_path: Path
    popen: subprocess.Popen[bytes]
    port: int | None = None  # what it serves on, when it is a server
    stop_timeout: float = 30.0  # SIGTERM to SIGKILL

    @property
    def base(self) -> str:
        assert self.port is not None, f"{self.name} has no port"
        return f"http://127.0.0.1:{self.port}"

    def check(self) -> None:
        if self.popen.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(f"{self.name} exited with {self.popen.returncode}; log {self.log_path}:\n{tail}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(30)


class Procs:
    """Every process this bench starts; `stop_all` stops them in reverse order."""

    def __init__(self, log_dir: Path | None = None) -> None:
        self.log_dir = log_dir  # where a process logs unless its spawn says
        self.started: list[Proc] = []

    def spawn(
        self,
        name: str,
        cmd: list[str],
        *,
        port: int | None = None,
        cores: tuple[int, ...] | None = None,
        log_path: Path | None = None,
        stop_timeout: float = 30.0,
    ) -> Proc:
        if log_path is None:
            assert self.log_dir is not None, "no log_dir and no log_path"
            log_path = self.log_dir / f"{name}.log"
        env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        if cores is not None:
            env["OMP_NUM_THREADS"] = str(len(cores))
        # Local addresses never through a proxy the environment names.
        env["NO_PROXY"] = ",".join(x for x in (env.get("NO_PROXY", ""), "127.0.0.1", "localhost") if x)
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=child_setup(cores),
            )
        proc = Proc(name, log_path, popen, port, stop_timeout)
        self.started.append(proc)
        return proc

    def stop(self, proc: Proc) -> None:
        proc.stop()
        if proc in self.started:
            self.started.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.started)):
            self.stop(proc)


def wait_until(ready: Callable[[], bool], procs: Sequence[Proc], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            p.check()
        with contextlib.suppress(httpx.HTTPError):
            if ready():
                return
        time.sleep(0.25)  # polling what the processes report, bounded by `timeout`
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")


def healthy(base: str) -> Callable[[], bool]:
    return lambda: httpx.get(f"{base}/health", timeout=5, trust_env=False).status_code == 200


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks; NaN for no values."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
