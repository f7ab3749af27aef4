"""bench/pd.py run end to end, as a user runs it, on the tiny preset with a handful of requests at two
rates: a PD stack and a colocated one behind sglang-router, every row of its table printed with its ratio,
the raw per-request CSV, the ITL plot. (Its figures are measured in `bench/`, never here.)"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RATES = ("2", "4")
REQUESTS = 4
OUTPUT_TOKENS = 6
RATIO = r"([<>]=? )?\d+\.\d\dx|n/a"  # a bound or n/a: goodput beyond the rates run, a figure missing


def _run(tiny: Path, out_dir: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pd.py"), "--preset", "tiny", "--model", str(tiny),
         "--rates", *RATES, "--requests", str(REQUESTS), "--long-tokens", "200", "300",
         "--short-tokens", "16", "32", "--output-tokens", str(OUTPUT_TOKENS), "--unloaded-repeats", "1",
         "--hop-pairs", "3", "--request-timeout", "120", "--out-dir", str(out_dir)],
        capture_output=True, text=True, env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _table(out: str, header: str) -> list[list[str]]:
    """The cells of each row of the markdown table whose header starts with `header`."""
    block = out.split(header, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in block]


def test_pd_bench_prints_every_row_with_its_ratio_and_writes_csv_and_png(
    tiny_model: Path, tmp_path: Path
) -> None:
    out_dir = tmp_path / "out"
    out = _run(tiny_model, out_dir)

    rows = {cells[0]: cells for cells in _table(out, "| measure | PD | colocated |")}
    expected = ["unloaded TTFT, long prompt", "unloaded TTFT, short prompt", "unloaded ITL p50"]
    per_rate = ("ITL p50", "ITL p99", "TTFT p50", "TTFT p99", "output tokens/s", "requests meeting both SLOs")
    for rate in RATES:
        expected += [f"{rate} req/s: {m}" for m in per_rate]
    expected.append("goodput: highest rate with >= 90% meeting both SLOs")
    for name in expected:
        assert any(k.startswith(name) for k in rows), (name, out)
    assert len(rows) == len(expected), out
    for cells in rows.values():
        assert len(cells) == 5 and re.fullmatch(rf"({RATIO})( \(.*\))?", cells[3]), cells
    for rate in RATES:  # the target: printed, never failing the run
        assert re.fullmatch(r"<= 0\.50x (PASS|MISS)", rows[f"{rate} req/s: ITL p99"][4]), out
        for m in ("ITL p50", "ITL p99", "TTFT p50", "TTFT p99"):  # every request finished: real figures
            assert re.fullmatch(r"\d+\.\d\dx", rows[f"{rate} req/s: {m}"][3]), rows[f"{rate} req/s: {m}"]
    assert re.search(r"SLOs \(from colocated's unloaded figures.*TTFT <= 5x.*ITL .* <= 3x", out), out

    hop = _table(out, "| router hop (same request, one at a time) |")
    assert len(hop) == 8, out  # four cases, p50 and p99 each
    for cells in hop:
        assert re.fullmatch(r"[+-]\d+\.\d ms", cells[3]) and re.fullmatch(r"\d+\.\d\dx", cells[4]), cells

    with (out_dir / "requests.csv").open() as f:
        reqs = list(csv.DictReader(f))
    assert len(reqs) == 2 * len(RATES) * REQUESTS
    for column in ("config", "rate", "request", "kind", "prompt_tokens", "ttft_s", "e2e_s", "output_tokens",
                   "tpot_s", "meets_ttft_slo", "meets_itl_slo", "error", "itl_gaps_s"):  # fmt: skip
        assert column in reqs[0], column
    assert {(r["config"], float(r["rate"])) for r in reqs} == {
        (c, float(x)) for c in ("pd", "colocated") for x in RATES
    }
    for r in reqs:
        assert r["error"] == "" and int(r["output_tokens"]) == OUTPUT_TOKENS, r
        assert len(r["itl_gaps_s"].split()) == OUTPUT_TOKENS - 1, r  # every gap after the first token
        lo, hi = (200, 300) if r["kind"] == "long" else (16, 32)
        assert lo <= int(r["prompt_tokens"]) <= hi, r  # as the server counted them
    assert {r["kind"] for r in reqs} == {"long", "short"}
    assert (out_dir / "itl_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out_dir / "router_hop.csv").exists() and (out_dir / "unloaded.csv").exists()
