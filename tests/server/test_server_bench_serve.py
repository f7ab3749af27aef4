"""`bench/serve.py --base-url` against a server that is already running (the real engine, in a thread):
it sends every request, prints its table, and draws Poisson arrivals reproducibly. Structure only,
never speed."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsv4_engine.server.app import create_app

NAME = "dsv4-tiny"
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "serve.py"


def _bench_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def base(llm: Any, tiny_checkpoint: Path, serve: Any) -> Iterator[str]:
    from dsv4_engine.server.args import ServerSettings

    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME)
    with serve(create_app(settings, lambda: llm.engine)) as url:
        yield url


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300
    )


def _rows(stdout: str) -> dict[str, str]:
    return {m[1]: m[2] for m in re.finditer(r"^  (\S.*?\S)  +(\S.*)$", stdout, re.M)}


def test_base_url_measures_a_running_server(base: str, tiny_checkpoint: Path) -> None:
    common = ["--clients", "4", "--prompt-len", "4", "12", "--output-len", "5", "--repeat", "1"]
    r = _run(
        "--base-url", f"{base}/v1", "--checkpoint", str(tiny_checkpoint), "--request-rate", "50", *common
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _rows(r.stdout)
    assert "endpoint benchmark (1 runs)" in r.stdout
    assert rows["endpoint / model"] == f"{base} / {NAME}"  # /v1 stripped, model from /v1/models
    assert rows["request rate"] == "50/s, Poisson"
    assert rows["completed / failed"] == "4 / 0"
    assert rows["output tokens"] == str(4 * 5)  # ignore_eos: every request runs to --output-len
    assert rows["requests per run"].startswith("4 (prompt ")
    for key in ("TTFT p50 / p99", "ITL p50 / p99"):
        assert re.fullmatch(r"\d+\.\d / \d+\.\d ms", rows[key]), rows[key]
    assert re.fullmatch(r"\d+\.\d  \(median \d+\.\d\)", rows["served tok/s"]), rows["served tok/s"]


def test_base_url_reports_failures(base: str) -> None:
    # A model name the server does not serve: every request fails, the table says so, exit status 1.
    r = _run("--base-url", base, "--model", "no-such-model", "--clients", "2", "--output-len", "2",
             "--prompt-len", "3", "3", "--repeat", "1", "--vocab-size", "64")  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert _rows(r.stdout)["completed / failed"] == "0 / 2"
    assert "failed request: HTTPStatusError" in r.stdout


def test_poisson_arrivals_are_seeded() -> None:
    bench = _bench_module()
    a, b = bench.arrival_offsets(200, 10.0, 7), bench.arrival_offsets(200, 10.0, 7)
    assert a == b and a != bench.arrival_offsets(200, 10.0, 8)
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert 0.07 < sum(gaps) / len(gaps) < 0.13  # mean gap 1/rate (seeded, so this is deterministic)
    assert bench.arrival_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        bench.arrival_offsets(3, 0.0, 0)
