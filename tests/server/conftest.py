"""Fixtures for the server tests: the tiny checkpoint, its tokenizer, and a uvicorn server in a thread."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

SERVED_NAME = "dsv4-tiny"
START_TIMEOUT = 120.0


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4_engine.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("server-ckpt") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoint))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def run_server(app: Any, *, wait_ready: bool = True) -> Iterator[str]:
    """Serve `app` with uvicorn on a free 127.0.0.1 port in a thread; yields the base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: server.started, START_TIMEOUT, "uvicorn to start")
        if wait_ready:
            wait_until(lambda: _healthy(base), START_TIMEOUT, "/health to answer 200")
        yield base
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "uvicorn thread did not stop"


@pytest.fixture
def settings_factory(tiny_checkpoint: Path) -> Callable[..., Any]:
    from dsv4_engine.server.args import ServerSettings

    def make(**overrides: Any) -> ServerSettings:
        values: dict[str, Any] = {"model": str(tiny_checkpoint), "served_model_name": SERVED_NAME}
        values.update(overrides)
        return ServerSettings(**values)

    return make


def load_sibling(filename: str) -> Any:
    """A module of this folder, by path: in importlib import mode sibling modules are not importable
    by name."""
    spec = importlib.util.spec_from_file_location(
        f"server_{Path(filename).stem}", Path(__file__).with_name(filename)
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pydantic look their module up while classes are built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def fake_engine_cls() -> Any:
    return load_sibling("fake_engine.py").FakeEngine


@pytest.fixture(scope="session")
def agent_task() -> Any:
    """agent_task.py: the two-tool task the Agents SDK runs (also loaded by tests/up)."""
    return load_sibling("agent_task.py")


@pytest.fixture(scope="session")
def serve() -> Callable[..., Any]:
    return run_server


@pytest.fixture(scope="session")
def until() -> Callable[..., None]:
    return wait_until


@pytest.fixture(scope="session")
def llm(tiny_checkpoint: Path) -> Any:
    """The real engine, shared: offline references first, then servers drive `llm.engine` one at a time."""
    from dsv4_engine.llm import LLM

    return LLM(str(tiny_checkpoint))


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def free_port_factory() -> Callable[[], int]:
    return free_port


class ServeProcess:
    """`dsv4 serve` as its own process on 127.0.0.1 (what a user runs), its output in `log_path`."""

    def __init__(self, args: list[str], port: int, log_path: Path, env: dict[str, str]) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        cmd = [sys.executable, "-c", "import sys; from dsv4_operator.cli import main; sys.exit(main())"]
        cmd += ["serve", *args, "--host", "127.0.0.1", "--port", str(port)]
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        assert self.proc.poll() is None, f"dsv4 serve exited {self.proc.returncode}:\n{self.log()[-4000:]}"
        try:
            return httpx.get(f"{self.base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[Callable[..., ServeProcess]]:
    """Start `dsv4 serve ARGS` (`serve_process(*args, timeout=..., env=..., port=...)`: a free port
    unless given, as a restarted server keeps its own), returned once healthy; every one still running
    is killed at the end of the test."""
    started: list[ServeProcess] = []

    def start(
        *args: str, timeout: float = 300.0, env: dict[str, str] | None = None, port: int | None = None
    ) -> ServeProcess:
        env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", **(env or {})}
        port = port if port is not None else free_port()
        server = ServeProcess(list(args), port, tmp_path / f"serve-{len(started)}.log", env)
        started.append(server)
        wait_until(server.healthy, timeout, f"dsv4 serve {' '.join(args)} to become healthy")
        return server

    yield start
    for server in started:
        server.stop()
