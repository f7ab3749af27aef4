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
        capture_output=True, text=True, env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    table = out.split("| measure |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]  # the main table's rows
    names = [row.split("|")[1].strip() for row in table]
    for expected in (
        "memcpy, same bytes",
        "iperf3 -n",
        "fresh pools, direct",
        "fragmented pools, direct",
        "fragmented pools, staged:",
        "fragmented pools, staged_pipelined",
        "source contiguous pools, direct",
        "source contiguous pools, unpack_only",
        "destination contiguous pools, direct",
        "destination contiguous pools, pack_only",
        "destination contiguous pools, pack_only_pipelined",
        "ceiling: the same bytes as one entry",
        "handshake:",
        "first write of the request, fresh",
        "per-request transfer, fresh",
    ):
        assert any(n.startswith(expected) for n in names), (expected, out)
    for row in table:  # every figure with its ratio against its reference
        assert re.search(r"\| \d+(\.\d+)?(x|%) \|", row), row
    # Each layout's target is judged on the one path the server picks for it (transfer.choose_write);
    # every other path of that layout names the pick.
    for layout, target in (("fresh", 70), ("fragmented", 50), ("source contiguous", 50),
                           ("destination contiguous", 50)):  # fmt: skip
        rows = [r for r in table if r.startswith(f"| {layout} pools, ")]
        picked = [r for r in rows if "(the server's path)" in r]
        assert len(picked) == 1 and re.search(rf">= {target}% (PASS|MISS)", picked[0]), (layout, out)
        assert all("(the server takes " in r for r in rows if r not in picked), (layout, out)
    assert re.search(r"staged: pack \d+\.\d+ ms \+ 1 entry \d+\.\d+ ms \+ unpack \d+\.\d+ ms", out), out
    assert re.search(r"prefill of the same request \(max_tokens=1\): \d+\.\d+ s", out), out
    assert re.search(r"\| fragmented: 64 entries per call \(\d+ entries\) \| \d+\.\d+ \(", out), out
    # The cost model's constants as this run measured them, and its time for every case.
    model = out.split("cost model (disagg/transfer.py COSTS)", 1)[1]
    for constant in ("entry", "wire", "pack", "unpack", "piece", "overlap"):
        assert re.search(rf"^\| {constant} \| ", model, flags=re.MULTILINE), (constant, out)
    assert len(re.findall(r"\| yes \|$", model, flags=re.MULTILINE)) == 4  # one pick per layout
