"""--transfer-protocol ascend and rdma without the hardware: the hostname and engine arguments that
reach Mooncake (a recording TransferEngine, tests/disagg/fake_mooncake, stands in for it: the one
fake these tests allow), and a missing NPU refused at startup with one clear line, not a traceback."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4_engine.disagg.mooncake import MOONCAKE_ENV_DEFAULTS, create_transport, engine_device

FAKE = Path(__file__).with_name("fake_mooncake")


def calls(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture
def fake_mooncake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """This process imports the recording engine as `mooncake.engine` (sys.modules restored after)."""
    for name, path in (
        ("mooncake", FAKE / "mooncake" / "__init__.py"),
        ("mooncake.engine", FAKE / "mooncake" / "engine.py"),
    ):
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        monkeypatch.setitem(sys.modules, name, module)
    for key in MOONCAKE_ENV_DEFAULTS:  # the transport sets these where unset: undone after the test
        had = key in os.environ
        monkeypatch.setenv(key, os.environ.get(key, ""))
        if not had:
            monkeypatch.delenv(key)
    log = tmp_path / "mooncake.jsonl"
    monkeypatch.setenv("FAKE_MOONCAKE_LOG", str(log))
    return log


def test_rdma_passes_its_device_and_ascend_maps_the_logical_npu(
    fake_mooncake: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSV4_DISAGGREGATION_IB_DEVICE", "mlx5_1")
    with create_transport("127.0.0.1", "rdma", "cuda:0") as t:
        assert t.session_id == "127.0.0.1:17777"
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5")
    with create_transport("127.0.0.1", "ascend", "npu:1") as t:
        assert t.session_id == "127.0.0.1:17777"  # peers dial host:rpc port, not the NPU suffix
    rdma, ascend = [c["args"] for c in calls(fake_mooncake) if c["call"] == "initialize"]
    assert rdma == ["127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_1"]
    assert re.fullmatch(r"127\.0\.0\.1:\d+:npu_5", ascend[0]) and ascend[1:] == ["P2PHANDSHAKE", "ascend", ""]


@pytest.mark.parametrize(
    ("device", "env", "message"),
    [
        ("cpu", {}, "--transfer-protocol ascend needs an NPU"),
        ("npu:2", {"ASCEND_RT_VISIBLE_DEVICES": "4,5"}, "has no physical id for logical NPU 2"),
        ("npu", {"ASCEND_RT_VISIBLE_DEVICES": "x"}, "ASCEND_RT_VISIBLE_DEVICES='x'"),
    ],
)
def test_an_npu_id_that_cannot_be_found_is_named(device: str, env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        engine_device("ascend", device, env)
    assert engine_device("ascend", "npu:3", {}) == (3, "")  # no remapping: the logical index
    assert engine_device("tcp", device, env) == (None, "")


def test_an_ascend_prefill_starts_with_the_npu_physical_id_in_its_hostname(
    spawn: Any, pd: Any, tmp_path: Path
) -> None:
    """A real `dsv4 serve` on the ascend protocol (the pools stay on this CPU; only Mooncake is
    stood in for): it becomes healthy, and Mooncake was initialised with ip:port:npu_<physical id>
    from ASCEND_RT_VISIBLE_DEVICES, its bootstrap endpoint naming the session peers dial."""
    log = tmp_path / "mooncake.jsonl"
    path = os.pathsep.join(p for p in (str(FAKE), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "FAKE_MOONCAKE_LOG": str(log), "ASCEND_RT_VISIBLE_DEVICES": "4,5"}
    server = spawn("PA", "--disaggregation-mode", "prefill", "--transfer-protocol", "ascend", env=env)
    pd.wait_healthy(server)
    (init,) = [c["args"] for c in calls(log) if c["call"] == "initialize"]
    assert re.fullmatch(r"127\.0\.0\.1:\d+:npu_4", init[0]) and init[1:] == ["P2PHANDSHAKE", "ascend", ""]
    route = httpx.get(f"http://127.0.0.1:{server.bootstrap_port}/route", timeout=10).json()
    assert route["ranks"] == [{"rank": 0, "mooncake_session": "127.0.0.1:17777"}]


def test_an_ascend_server_without_an_npu_exits_with_one_clear_line(tiny_model: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_RT_VISIBLE_DEVICES"}
    cmd = [sys.executable, "-c", "import sys; from dsv4_operator.cli import main; sys.exit(main())", "serve",
           "--model", str(tiny_model), "--disaggregation-mode", "decode", "--transfer-protocol", "ascend"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "dsv4 serve: error: --transfer-protocol ascend needs an NPU" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
