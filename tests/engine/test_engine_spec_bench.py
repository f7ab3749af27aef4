"""bench/spec.py run end to end, as a user runs it, with `--quick` on the demo model with an MTP layer
(tests/speculative_util.py): every row of its table with a ratio to speculation off, greedy outputs
equal to off's, the goal line, and the CSVs with counters that add up. (Its figures are measured in
`bench/`, never here.)"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from speculative_util import mtp_checkpoint  # tests/ is on sys.path (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "spec.py"
QUICK_STEPS = 2  # what --quick measures


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
        timeout=300,
    )


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_spec", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while classes are built
    spec.loader.exec_module(module)
    return module


def test_quick_run_prints_every_row_and_writes_counters_that_add_up(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    checkpoint = mtp_checkpoint(tmp_path_factory.mktemp("spec-bench") / "demo-mtp")
    out_dir = tmp_path_factory.mktemp("spec-bench-out")
    proc = _run("--quick", "--model", str(checkpoint), "--out-dir", str(out_dir))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout

    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in out.splitlines()
        if re.match(r"^\| \S+ \| \d+ \| (off|k=\d) \|", line)
    ]
    assert [(r[1], r[2]) for r in rows] == [
        (b, s) for b in ("1", "8") for s in ("off", f"k={QUICK_STEPS}")
    ], out
    for r in rows:
        assert re.fullmatch(r"\d+\.\d \(\d+\.\d-\d+\.\d\)", r[3]), r
        assert re.fullmatch(r"\d+\.\d\dx", r[4]), r
        if r[2] == "off":
            assert r[4] == "1.00x" and r[7] == "reference", r
        else:  # speculation never changes a greedy output
            assert re.fullmatch(r"\d\.\d\d", r[5]) and 1 <= float(r[5]) <= 1 + QUICK_STEPS, r
            assert re.fullmatch(r"\d+\.\d%", r[6]), r
            assert r[7] == "equal to off", r
    assert "MISMATCH" not in out
    assert re.search(
        r"^goal: >= 1\.6x decode tok/s at batch 1 on the demo model.*: best k=2 \d+\.\d\dx (PASS|MISS)$",
        out,
        re.M,
    ), out
    assert "small preset: skipped (--no-small)" in out

    with (out_dir / "runs.csv").open() as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 4
    for run in runs:
        drafts, drafted, accepted = (
            int(run[c])
            for c in (
                "spec_decode_num_drafts",
                "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens",
            )
        )
        batch, k = int(run["batch"]), int(run["k"])
        # Every request decodes max_tokens - 1 tokens after its first (ignore_eos).
        assert int(run["decode_tokens"]) == batch * (32 - 1), run
        if k == 0:
            assert drafts == drafted == accepted == 0, run
        else:
            assert 0 < drafts <= drafted <= k * drafts and accepted <= drafted, run
    with (out_dir / "steps.csv").open() as f:
        steps = list(csv.DictReader(f))
    # Tokens per decode step: each request's decode tokens, accounted for step by step.
    for batch in (1, 8):
        for k in (0, QUICK_STEPS):
            mine = [s for s in steps if int(s["batch"]) == batch and int(s["k"]) == k]
            assert sum(int(s["tokens_per_step"]) * int(s["steps"]) for s in mine) == batch * 31
            assert all(1 <= int(s["tokens_per_step"]) <= 1 + k for s in mine)


def test_a_checkpoint_without_an_mtp_layer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 0}))
    proc = _run("--quick", "--model", str(tmp_path), "--out-dir", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "has no MTP layer" in proc.stdout


def test_a_mismatch_names_the_request_and_token() -> None:
    bench = _bench()
    off = [[5, 6, 7], [8, 9]]
    assert bench.first_difference(off, off) == ""
    assert bench.first_difference([[5, 6, 7], [8, 4]], off) == "request 1, token 1"

    def run(k: int, outputs: list[list[int]], tokens: int) -> Any:
        counters = {"spec_decode_num_drafts": 4.0, "spec_decode_num_draft_tokens": 8.0}
        counters["spec_decode_num_accepted_tokens"] = 2.0
        return bench.Run(
            "demo", 1, k, 0, 1.0, 1.0, tokens, outputs, counters if k else dict.fromkeys(counters, 0.0)
        )

    rows = bench.rows_of([run(0, off, 100), run(2, [[5, 6, 7], [8, 4]], 170)])
    assert rows[1].mismatch == "MISMATCH in 1 of 1 runs, e.g. request 1, token 1"
    assert rows[1].ratio == pytest.approx(1.7)
    assert rows[1].mean_length == pytest.approx(1.5) and rows[1].acceptance == pytest.approx(0.25)
    assert "MISMATCH in 1 of 1 runs" in bench.table(rows)[-1]
    assert bench.goal(rows, "demo", True).endswith("best k=2 1.70x PASS")
