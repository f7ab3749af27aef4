"""bench/pd_transfer.py run end to end, as a user runs it, on a tiny workload: it checks the bytes of
every case itself (a mismatch fails the run) and prints every row with its ratio and the targets'
PASS/MISS. (Its figures are measured in `bench/`, never here.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4_engine.make_tiny import make_tiny
    from dsv4_engine.testing import one_thread

    with one_thread():
        return make_tiny(tmp_path_factory.mktemp("pd_bench") / "tiny", seed=0, preset="tiny")


def test_pd_transfer_bench_prints_every_case_with_its_ratio(tiny: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pd_transfer.py"), "--model", str(tiny), "--tokens", "384",
         "--repeats", "2", "--sweep", "1"],
        capture_output=True, text=True, env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    table = out.split("| measure |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]  # the main table's rows
    names = [row.split("|")[1].strip() for row in table]
    for expected in (
        "memcpy, same bytes",
        "iperf3 -n",
        "fresh pools, direct:",
        "fragmented pools, direct:",
        "ceiling: the same bytes as one entry",
        "fragmented pools, staged (the server's path):",
        "staged against direct, fragmented pools",
        "handshake:",
        "first write of the request, fresh",
        "per-request transfer, fresh",
    ):
        assert any(n.startswith(expected) for n in names), (expected, out)
    for row in table:  # every figure with its ratio against its reference
        assert re.search(r"\| \d+(\.\d+)?(x|%) \|", row), row
    # Each target is judged on the path the server picks for those pages (transfer.stage_pays).
    assert re.search(r"fresh pools, direct: \d+ entries .*>= 70% (PASS|MISS)", out), out
    assert re.search(r"fragmented pools, direct: \d+ entries .*\(the server stages these\)", out), out
    assert re.search(r"staged \(the server's path\): pack .*>= 50% (PASS|MISS)", out), out
    assert re.search(r"prefill of the same request \(max_tokens=1\): \d+\.\d+ s", out), out
    assert re.search(r"\| fragmented: 64 entries per call \(\d+ entries\) \| \d+\.\d+ \(", out), out
