"""The two engine benchmarks run end to end, as a user runs them, on a small workload: each prints its
table with every row and a ratio against HF. (Their figures are measured in `bench/`, never here.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def tiny(checkpoints: dict[str, Path]) -> Path:
    return next(iter(checkpoints.values()))


def test_decode_vs_hf_prints_each_row_with_its_ratio(tiny: Path) -> None:
    out = _run(
        "decode_vs_hf.py", "--model", str(tiny), "--impls", "engine,eager,hf",
        "--prompt-len", "8", "--new-tokens", "6", "--repeats", "1", "--threads", "1",
    )  # fmt: skip
    rows = {
        line.split("|")[0].strip(): line for line in out.splitlines() if re.search(r"\|\s*\d+\.\d+x$", line)
    }
    assert set(rows) == {"dsv4 engine", "batched eager", "HF generate"}, out
    assert rows["HF generate"].endswith("1.00x"), out
    assert re.search(r"\d+ ATen ops per step", out), out  # the footer says what bounds the step


def test_throughput_prints_the_workload_prefill_and_decode_rows(tiny: Path) -> None:
    out = _run(
        "throughput.py", "--model", str(tiny), "--num-requests", "4", "--min-prompt", "16",
        "--max-prompt", "40", "--output-len", "4", "--hf-requests", "1", "--peak-size", "256", "--threads", "1",
    )  # fmt: skip
    workload = next(
        line for line in out.splitlines() if line.startswith("| generated tokens/s, whole workload")
    )
    assert re.search(r"HF generate one by one \(1 req\).*\|\s*\d+\.\d+x\s*\|", workload), out
    assert re.search(r"\| prefill model GFLOP/s .*\| \d+% \|", out), out  # against the measured peak
    assert re.search(r"\| decode tokens/s, batch \S+ \(\d+ steps\) \| \d+\.\d", out), out
