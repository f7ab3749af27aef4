"""`dsv4 serve --tp-size 2`: serves the one-rank engine's greedy tokens through the official openai
client, exports its process-group prewarm time, and when a rank is killed goes down (exit 1) with a
line naming the rank, in bounded time."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import httpx
import psutil

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.testing import random_ids

TOKENS = 8


def test_tp2_server_serves_and_dies_with_its_rank(
    tiny_checkpoint: Path, llm: Any, serve_process: Any
) -> None:
    server = serve_process(
        "--model", str(tiny_checkpoint), "--served-model-name", "tiny", "--tp-size", "2",
        "--max-model-len", "1024", "--num-pages", "64", "--dtype", "float32",
    )  # fmt: skip
    from openai import OpenAI

    proc, base = server.proc, server.base
    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    prompt = random_ids(130, seed=130)
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))[0]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].text == want.text
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    prewarm = re.search(r"^dsv4_process_group_prewarm_seconds (\S+)$", metrics, re.M)
    assert prewarm is not None and float(prewarm.group(1)) > 0

    # The rank is a spawned child (multiprocessing's resource tracker is another child).
    (rank1,) = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
    rank1.send_signal(signal.SIGKILL)
    assert proc.wait(120) == 1
    text = server.log()
    assert re.search(rf"dsv4-rank1 \(pid {rank1.pid}\) died \(killed by SIGKILL\)", text), text[-3000:]
