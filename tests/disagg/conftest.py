"""Real `dsv4 serve` processes on 127.0.0.1 for the PD tests: prefill, decode and colocated servers.

Servers run with DSV4_TEST_HOOKS=1: /debug/pause and /debug/resume hold work open deterministically,
/debug/state and /debug/pd expose pool counts, page digests and logit digests. No test sleeps:
each waits on an observable state (health, a queue depth, a pool count) with a generous bound.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

NAME = "tiny"
START_TIMEOUT = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Server:
    """One `dsv4 serve` process."""

    def __init__(self, model: Path, log_dir: Path, name: str, *args: str, env: dict[str, str] | None = None):
        self.name = name
        self.model = model
        self.args = list(args)
        self.port = free_port()
        self.bootstrap_port: int | None = None
        if "--disaggregation-mode" in self.args:
            i = self.args.index("--disaggregation-mode")
            if self.args[i + 1] == "prefill" and "--bootstrap-port" not in self.args:
                self.bootstrap_port = free_port()
                self.args += ["--bootstrap-port", str(self.bootstrap_port)]
        self.log_path = log_dir / f"{name}.log"
        self.env = {
            **os.environ,
            "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
            "DSV4_TEST_HOOKS": "1",
            "OMP_NUM_THREADS": "1",  # many servers share two cores
            "MC_TRANSFER_TIMEOUT": "5",  # Mooncake's minimum: quarantines last 10 s
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-c", "import sys; from dsv4_operator.cli import main; sys.exit(main())"]
        cmd += ["serve", "--model", str(self.model), "--served-model-name", NAME]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "4096", *self.args]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.log()[-4000:]}")
        try:
            if httpx.get(f"{self.base}/health", timeout=2).status_code != 200:
                return False
            pid = httpx.get(f"{self.base}/debug/state", timeout=5).json()["pid"]
        except httpx.HTTPError:
            return False
        # Another process may have taken the port between free_port() and this server's bind.
        assert pid == self.proc.pid, (
            f"{self.name}'s port {self.port} is answered by pid {pid}, not {self.proc.pid}"
        )
        return True

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> Any:
        return httpx.get(f"{self.base}{path}", timeout=30).json()

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.post(f"{self.base}{path}", timeout=120, **kw)

    def engine(self) -> dict[str, float]:
        return self.get("/debug/state")["engine"]

    def free_pages(self) -> dict[str, float]:
        """Pages no request holds, per family: free, or held by the prefix cache alone."""
        return {k: v for k, v in self.engine().items() if k.startswith("pool_available/")}

    def pause(self) -> None:
        assert self.post("/debug/pause").json()["paused"]

    def resume(self) -> None:
        self.post("/debug/resume").raise_for_status()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(60)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def wait_healthy(*servers: Server) -> None:
    for s in servers:
        wait_until(s.healthy, START_TIMEOUT, f"{s.name} to become healthy")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4_engine.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("pd-ckpt") / "tiny", seed=0, mtp=True)  # test_pd_speculative


@pytest.fixture(scope="module")
def spawn(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """Start servers (`spawn(name, *args)`, on the tiny model unless `model=`); every one is stopped
    when the module ends."""
    log_dir = tmp_path_factory.mktemp("pd-logs")
    started: list[Server] = []

    def make(name: str, *args: str, env: dict[str, str] | None = None, model: Path | None = None) -> Server:
        server = Server(model or tiny_model, log_dir, name, *args, env=env)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


def pd_body(prefill: Server, body: dict[str, Any], room: int | None = None) -> dict[str, Any]:
    import random

    assert prefill.bootstrap_port is not None
    return {
        **body,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": random.randrange(2**63) if room is None else room,
    }


def send_pair(
    prefill: Server, decode: Server, body: dict[str, Any], route: str = "/v1/completions", **kw: Any
) -> tuple[httpx.Response, httpx.Response]:
    """The router's dispatch: the same body to both servers at once."""
    with cf.ThreadPoolExecutor(2) as ex:
        p = ex.submit(httpx.post, f"{prefill.base}{route}", json=body, timeout=300, **kw)
        d = ex.submit(httpx.post, f"{decode.base}{route}", json=body, timeout=300, **kw)
        return p.result(), d.result()


def generate(server: Server, prompt: list[int], max_new_tokens: int, **params: Any) -> list[int]:
    """One server's `/generate` output ids (a colocated reference)."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, **params}}
    return server.post("/generate", json=body).json()["output_ids"]


def pd_generate(
    prefill: Server, decode: Server, prompt: list[int], max_new_tokens: int, **params: Any
) -> list[int]:
    """The same `/generate` through a prefill/decode pair: the decode's output ids, after checking
    both legs answered and the prefill made exactly the first token."""
    body = pd_body(
        prefill, {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, **params}}
    )
    p, d = send_pair(prefill, decode, body, "/generate")
    assert p.status_code == 200, p.text
    assert d.status_code == 200, d.text
    assert p.json()["output_ids"] == d.json()["output_ids"][:1]  # the prefill made exactly the first token
    return d.json()["output_ids"]


def settle(*servers: Server, initial: dict[str, dict[str, float]], timeout: float = 90.0) -> None:
    """Wait until every server's pools are back at their initial free counts and nothing is queued."""

    last: dict[str, Any] = {}

    def settled() -> bool:
        for s in servers:
            state = s.get("/debug/state")
            last[s.name] = {"state": state, "pd": s.get("/debug/pd")["depths"]}
            if state["open"] or state["inflight"]:
                return False
            if s.free_pages() != initial[s.name]:
                return False
            if any(s.get("/debug/pd")["depths"].values()):
                return False
            if state["engine"].get("num_held", 0):
                return False
        return True

    try:
        wait_until(settled, timeout, "pools back at their initial free counts and no PD request left")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; initial {initial}, last seen {last}") from None


@pytest.fixture(scope="session")
def pd() -> Any:
    """The helpers above, for test modules (importlib mode: they cannot import this file)."""
    import types

    return types.SimpleNamespace(
        send_pair=send_pair,
        pd_body=pd_body,
        settle=settle,
        wait_healthy=wait_healthy,
        wait_until=wait_until,
        generate=generate,
        pd_generate=pd_generate,
    )


# ---- sglang-router 0.3.2 in front of PD servers (tests/disagg/test_router_faults.py) -------------
ROUTER_START_TIMEOUT = 60.0


class Router:
    """One `python -m sglang_router.launch_router --pd-disaggregation` process on 127.0.0.1.

    Logs at debug level: each attempt is a line `PD retry attempt N using prefill=URL decode=URL`,
    which `attempts()` returns, so a test can tell which pair the router tried."""

    def __init__(
        self, log_dir: Path, name: str, prefills: list[Server], decodes: list[Server], *args: str
    ) -> None:
        self.name = name
        self.port = free_port()
        self.log_path = log_dir / f"router-{name}.log"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(free_port())]
        cmd += ["--log-level", "debug"]
        for p in prefills:
            cmd += ["--prefill", p.base, str(p.bootstrap_port)]
        for d in decodes:
            cmd += ["--decode", d.base]
        cmd += list(args)
        self.expected = len(prefills) + len(decodes)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        import re

        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"router {self.name} exited {self.proc.returncode}:\n{self.log()[-4000:]}")
        try:
            r = httpx.get(f"{self.base}/readiness", timeout=2)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.json().get("healthy_workers") == self.expected

    def healthy(self, server: Server) -> bool:
        """The router's own view of one worker (its health checker's verdict)."""
        workers = httpx.get(f"{self.base}/workers", timeout=5).json()["workers"]
        return next(w["is_healthy"] for w in workers if w["url"] == server.base)

    def attempts(self) -> list[tuple[int, str, str]]:
        """(attempt number, prefill URL, decode URL) of every dispatch so far, in order."""
        import re

        pattern = r"PD retry attempt (\d+) using prefill=(\S+) decode=(\S+)"
        return [(int(n), p, d) for n, p, d in re.findall(pattern, self.log())]

    def client(self, timeout: float) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # nothing to drain: the tests' clients have all been answered
        self.proc.wait(30)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Router]]:
    """Start routers (`router(name, prefills, decodes, *flags)`), ready once every worker is healthy
    in the router's view; every one is stopped when the module ends."""
    log_dir = tmp_path_factory.mktemp("router-logs")
    started: list[Router] = []

    def make(name: str, prefills: list[Server], decodes: list[Server], *args: str) -> Router:
        r = Router(log_dir, name, prefills, decodes, *args)
        started.append(r)
        wait_until(r.ready, ROUTER_START_TIMEOUT, f"router {name} to see its {r.expected} workers healthy")
        return r

    yield make
    for r in started:
        r.stop()
