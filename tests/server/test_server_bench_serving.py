"""sglang 0.5.23's own benchmark client, `python -m sglang.bench_serving`, against `dsv4 serve` on the tiny
checkpoint: `--backend sglang` (streaming `/generate`) and `--backend sglang-oai` (streaming
`/v1/completions`), each a small run over a local ShareGPT-format file, tokenized with the checkpoint's
own tokenizer, nothing downloaded (HF_HUB_OFFLINE). Every request completes with the fixed output length
it asked for, and the one vendor field `--backend sglang` sends that dsv4 does not know
(`return_routed_experts`) is ignored with the server's warning rather than refused.

The client lives in a venv of its own (scripts/get-sglang-bench.sh, run by scripts/test.sh): it needs
torch 2.14.1 and torchvision, which the project's .venv (torch 2.13 CPU) does not have."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

from suite import skips

ROOT = Path(__file__).resolve().parents[2]
NAME = "tiny"
PROMPTS = 4
OUTPUT_LEN = 8  # --sharegpt-output-len: bench_serving sends it as max_new_tokens / max_tokens with ignore_eos

CONVERSATIONS = [
    ("What is the capital of France, and why is it famous?", "Paris, for its art and its food."),
    ("Write a haiku about a quiet mountain lake at dawn.", "Still water, grey mist; a heron lifts."),
    ("Explain in two sentences how a hash map finds a key.", "It hashes the key to pick a bucket."),
    ("List three prime numbers larger than one hundred.", "One hundred and one, and three, and seven."),
    ("How do I reverse a list in Python without a copy?", "Call its reverse method, which works in place."),
    ("Summarise the plot of a detective story in one line.", "A clue, a suspect, a twist, the truth."),
]


def _client_python() -> str:
    got = subprocess.run(
        ["bash", str(ROOT / "scripts" / "get-sglang-bench.sh")], capture_output=True, text=True, timeout=1800
    )
    if got.returncode != 0:
        reason = (
            f"no sglang bench_serving venv (scripts/get-sglang-bench.sh failed: {got.stderr.strip()[-300:]})"
        )
        skips.missing(reason)
    return got.stdout.strip().splitlines()[-1]


def _sharegpt(path: Path) -> Path:
    rows = [
        {"id": f"conv-{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for i, (q, a) in enumerate(CONVERSATIONS)
    ]
    path.write_text(json.dumps(rows))
    return path


def _bench(
    python: str, backend: str, base: str, checkpoint: Path, dataset: Path, out: Path
) -> dict[str, Any]:
    cmd = [python, "-W", "ignore", "-m", "sglang.bench_serving", "--backend", backend, "--base-url", base]
    cmd += ["--model", NAME, "--tokenizer", str(checkpoint), "--dataset-name", "sharegpt"]
    cmd += ["--dataset-path", str(dataset), "--num-prompts", str(PROMPTS)]
    cmd += ["--sharegpt-output-len", str(OUTPUT_LEN), "--seed", "1", "--warmup-requests", "1"]
    cmd += ["--output-file", str(out), "--output-details", "--disable-tqdm"]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
    }
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=out.parent, env=env)
    log = (got.stdout + got.stderr)[-6000:]
    assert got.returncode == 0, log
    (line,) = out.read_text().splitlines()  # one JSON line per run, appended
    result = json.loads(line)
    assert result["backend"] == backend, log
    return result | {"log": log}


def test_bench_serving_completes_against_dsv4_serve(
    tiny_checkpoint: Path, serve_process: Any, tmp_path: Path
) -> None:
    python = _client_python()
    server = serve_process("--model", str(tiny_checkpoint), "--served-model-name", NAME)
    dataset = _sharegpt(tmp_path / "sharegpt.json")
    for backend in ("sglang", "sglang-oai"):
        result = _bench(python, backend, server.base, tiny_checkpoint, dataset, tmp_path / f"{backend}.jsonl")
        log = result["log"]
        assert result["completed"] == PROMPTS, log
        assert result["errors"] == [""] * PROMPTS, log
        assert result["output_lens"] == [OUTPUT_LEN] * PROMPTS, log  # counted from the server's usage
        assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN
        assert all(n > 1 for n in result["input_lens"]), result["input_lens"]
        assert all(result["generated_texts"]), result["generated_texts"]
        assert all(t > 0 for t in result["ttfts"]), result["ttfts"]
        assert result["server_info"]["served_model_name"] == NAME  # read from /server_info

    # The access log's line for a streamed response is written once it has ended, which may be just after
    # the client read its last chunk: stop the server (SIGTERM drains, then exits) before reading it.
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(120) == 0, server.log()[-3000:]
    served = server.log()
    for route in ("/generate", "/v1/completions"):  # warm-up and the prompts, each a 200
        assert served.count(f'"POST {route}" 200') == PROMPTS + 1, served[-3000:]
    assert not re.search(r'" [45]\d\d ', served), served[-3000:]
    ignored = "ignored request fields this server does not know: return_routed_experts"
    assert served.count(ignored) == PROMPTS + 1, served[-3000:]  # --backend sglang's, on /generate
