"""`dsv4 up` as a subprocess: its output read line by line on a thread, waits bounded and keyed on
what it prints (a state line, the endpoint) or on what the servers answer, never on time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

ROOT = Path(__file__).resolve().parents[2]
CPU_TINY = ROOT / "examples" / "cpu-tiny.yaml"
START_TIMEOUT = 240.0
STARTING = re.compile(r"^dsv4 up +[\d.]+s +(\S+) +starting +pid (\d+) +(\S+)")
ENDPOINT = re.compile(r"^dsv4 up: endpoint (\S+)")


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)  # polling an observable state, bounded by `timeout`
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes (nothing runs), but kill(0) still finds it
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


class Up:
    """One `dsv4 up` process; `lines` is everything it printed (stdout and stderr) so far."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        cmd = [sys.executable, "-c", "import sys; from dsv4_operator.cli import main; sys.exit(main())"]
        self.proc = subprocess.Popen(
            [*cmd, "up", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            bufsize=1,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, pattern: str | re.Pattern[str], timeout: float = START_TIMEOUT) -> re.Match[str]:
        """The first printed line matching `pattern`; fails if dsv4 up ends without printing it."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if match := regex.search(line):
                        return match
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    raise AssertionError(f"dsv4 up never printed {regex.pattern!r}:\n{self.output}")
                self._changed.wait(left)

    def endpoint(self) -> str:
        return self.wait_line(ENDPOINT).group(1)

    def children(self) -> dict[str, tuple[int, str]]:
        """name -> (pid, URL) of every process it started, from its `starting` lines."""
        found = [STARTING.search(line) for line in self.lines]
        return {m.group(1): (int(m.group(2)), m.group(3)) for m in found if m}

    def wait(self, timeout: float = 180.0) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(30)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        for pid, _ in self.children().values():  # never leave a server behind, whatever failed
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def until() -> Callable[[Callable[[], bool], float, str], None]:
    return wait_until


@pytest.fixture(scope="session", name="alive")
def alive_fixture() -> Callable[[int], bool]:
    return alive


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4_engine.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("up-ckpt") / "tiny", seed=0)


@pytest.fixture
def spec_for(tmp_path: Path) -> Callable[..., Path]:
    """A copy of the CPU tiny example serving the checkpoint at `model` (a hostPath on this machine)."""

    def write(model: Path, **engine: Any) -> Path:
        doc = yaml.safe_load(CPU_TINY.read_text())
        doc["spec"]["model"] = {"servedModelName": "dsv4-tiny", "hostPath": {"path": str(model)}}
        doc["spec"]["engine"].update(engine)
        path = tmp_path / f"spec-{model.name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    return write


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Callable[..., Up]]:
    """Start `dsv4 up -f SPEC --ports free` with the test hooks on; every run is stopped at the end."""
    runs: list[Up] = []

    def start(spec: Path, *extra: str) -> Up:
        env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "DSV4_TEST_HOOKS": "1"}
        argv = ["-f", str(spec), "--ports", "free", "--log-dir", str(tmp_path / "logs"), *extra]
        runs.append(Up(argv, env))
        return runs[-1]

    yield start
    for run in runs:
        run.stop()
