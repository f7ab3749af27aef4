"""bench/accuracy.py's CPU path: lm-eval's API clients against a served demo model, with local
questions shaped like GSM8K and GPQA, offline, and the table with V4-Flash's gates. The endpoint here
is one in-process server on the bundled demo checkpoint (quick); the same lm-eval clients through
`dsv4 up`'s router are tests/up/test_up_cluster.py::test_lm_eval_through_up."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
NAME = "dsv4-demo"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_accuracy", ROOT / "bench" / "accuracy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@contextmanager
def _served(checkpoint: Path) -> Iterator[tuple[str, Any]]:
    """The real engine on `checkpoint` behind `dsv4 serve`'s app, on a free port, in this process."""
    import uvicorn

    from dsv4_engine.llm import LLM
    from dsv4_engine.server.app import create_app
    from dsv4_engine.server.args import ServerSettings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    llm = LLM(str(checkpoint))
    app = create_app(ServerSettings(model=str(checkpoint), served_model_name=NAME), lambda: llm.engine)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="accuracy-bench-server", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(base):  # polling the server's own health, bounded
            assert time.monotonic() < deadline, "the demo server did not become healthy"
            time.sleep(0.05)
        yield base, llm
    finally:
        server.should_exit = True
        thread.join(30)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_demo_path_scores_local_questions_through_an_endpoint(tmp_path: Path) -> None:
    from dsv4_engine import demo
    from dsv4_engine.sampling_params import SamplingParams

    bench = _bench()
    checkpoint = demo.bundled()
    with _served(checkpoint) as (base, llm):
        with bench.offline(tmp_path):  # any download would fail the run
            rows, raw = bench.evaluate(base, NAME, str(checkpoint), demo=True, limit=None, work=tmp_path)
        assert [(r.gate.name, r.task, r.n) for r in rows] == [
            ("gsm8k", "dsv4_demo_gsm8k", len(bench.DEMO_GSM8K)),
            ("gpqa", "dsv4_demo_gpqa", len(bench.DEMO_GPQA)),
        ]
        assert all(0.0 <= r.score <= 1.0 for r in rows)
        # The completions run got the engine's own greedy text for lm-eval's prompts.
        for sample in raw["gsm8k"]["samples"]["dsv4_demo_gsm8k"]:
            (context, kwargs) = sample["arguments"][0]
            want = llm.generate([context], SamplingParams(temperature=0.0, max_tokens=kwargs["max_gen_toks"]))
            text = want[0].text
            for stop in kwargs["until"]:
                text = text.split(stop)[0]
            assert sample["resps"][0][0] == text
        # The chat run sent conversations (the server applies the model's chat template).
        context = raw["gpqa"]["samples"]["dsv4_demo_gpqa"][0]["arguments"][0][0]
        messages = json.loads(context[0] if isinstance(context, tuple | list) else context)
        assert messages[0]["role"] == "user"
        assert messages[0]["content"].startswith("What is the correct answer to this question:")
    out = bench.table(rows, demo=True)
    assert out.splitlines()[1].split()[:3] == ["gsm8k", "dsv4_demo_gsm8k", str(len(bench.DEMO_GSM8K))]
    assert "0.930" in out and "0.874" in out and out.count("not applied (demo model)") == 2


def test_the_gates_are_v4_flash_thresholds_and_fail_below_them() -> None:
    bench = _bench()
    gates = {g.name: g for g in bench.GATES}
    assert (gates["gsm8k"].task, gates["gsm8k"].threshold, gates["gsm8k"].num_fewshot) == ("gsm8k", 0.93, 5)
    assert (gates["gpqa"].task, gates["gpqa"].threshold) == ("gpqa_diamond_cot_zeroshot", 0.874)
    assert gates["gpqa"].gen_kwargs["chat_template_kwargs"] == {"thinking": True, "reasoning_effort": "high"}
    low, high = bench.Row(gates["gsm8k"], "gsm8k", 1319, 0.929), bench.Row(gates["gpqa"], "gpqa", 198, 0.9)
    assert not low.passed and high.passed
    assert "FAIL" in bench.table([low, high], demo=False).splitlines()[1]
    with pytest.raises(SystemExit) as err:  # the demo model can never meet them
        bench.main(["--demo", "--gate"])
    assert err.value.code == 2
