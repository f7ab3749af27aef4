"""Accuracy gates, GSM8K and GPQA, through the PD endpoint with lm-eval; prints one table.

    # hardware: the real checkpoint behind the router (Service, `dsv4 up`, any OpenAI endpoint)
    python bench/accuracy.py --base-url http://dsv4.llm.svc:8000 --model deepseek-v4-flash \\
        --tokenizer /models/DeepSeek-V4-Flash --gate
    # CPU: the bundled demo model behind `dsv4 up` (prefill + decode + router on 127.0.0.1), a few
    # local questions shaped like each benchmark's, nothing downloaded: proves the path, not the model
    python bench/accuracy.py --demo [--base-url URL]

Each gate runs lm-eval 0.4.13's own task against the endpoint: `gsm8k` (5-shot, `local-completions`
with text prompts, which is all sglang-router 0.3.2 takes on /v1/completions) and
`gpqa_diamond_cot_zeroshot` (`local-chat-completions` with the chat template and DSV4's thinking mode
at high effort, sampled as the reference run was). Their datasets come from the Hugging Face Hub
(GPQA is gated: set HF_TOKEN, or pre-fill HF_DATASETS_CACHE and set HF_DATASETS_OFFLINE=1).
`--limit N` scores the first N questions of each. `--gate` exits 1 when a score is below its
threshold.

The thresholds are DeepSeek-V4-Flash's. The seed PR's text records none; they come from the seed's
project (SGLang), as docs/npu.md lists:
- GSM8K 0.93: SGLang's V4-Flash accuracy check (reference/dsv4-model-and-pd.md; CUDA, greedy). Here
  the metric is lm-eval's `exact_match,flexible-extract`, which SGLang's own few-shot GSM8K script
  approximates (last number of the answer).
- GPQA Diamond 0.874: SGLang's Ascend gate `test/registered/ascend/accuracy/deepseek_v4_flash/
  test_npu_deepseek_v4_flash_w8a8_8p_gpqa.py` (W8A8, 8 NPUs, thinking on at reasoning_effort high,
  0-shot, temperature 1, top_p 1, up to 125000 tokens; "official GPQA Diamond baseline 87.4%").

`--demo` replaces the datasets by questions written for this script in their formats (the same
prompt templates and answer filters as the real tasks; none is copied from GSM8K or GPQA, whose
test sets must stay out of training data) and generates a few tokens: the demo model was trained on
Python's documentation, so its scores are near zero and no threshold applies.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True)
class Gate:
    name: str
    task: str  # lm-eval's task (hardware)
    model_type: str  # lm-eval's API model
    metric: str
    threshold: float
    source: str
    num_fewshot: int
    gen_kwargs: dict[str, Any] = field(default_factory=dict)


GATES = (
    Gate(
        name="gsm8k",
        task="gsm8k",
        model_type="local-completions",
        metric="exact_match,flexible-extract",
        threshold=0.93,
        source="SGLang's V4-Flash GSM8K check (CUDA)",
        num_fewshot=5,
    ),
    Gate(
        name="gpqa",
        task="gpqa_diamond_cot_zeroshot",
        model_type="local-chat-completions",
        metric="exact_match,flexible-extract",
        threshold=0.874,
        source="SGLang test_npu_deepseek_v4_flash_w8a8_8p_gpqa.py (Ascend W8A8 8p, thinking high)",
        num_fewshot=0,
        gen_kwargs={
            "max_gen_toks": 125000,
            "temperature": 1.0,
            "top_p": 1.0,
            "do_sample": True,
            "chat_template_kwargs": {"thinking": True, "reasoning_effort": "high"},
        },
    ),
)

# --demo: questions in each benchmark's format, written for this script.
DEMO_GSM8K = [
    {"question": "A shelf holds 4 rows of 6 books. 5 books are taken away. How many books are left?",
     "answer": "4 rows of 6 books is 4 * 6 = 24 books. 24 - 5 = 19.\n#### 19"},
    {"question": "Tom has 12 apples and gives a third of them to Ann. How many apples does Tom keep?",
     "answer": "A third of 12 is 12 / 3 = 4. Tom keeps 12 - 4 = 8.\n#### 8"},
    {"question": "A train travels 60 km each hour for 3 hours. How far does it go?",
     "answer": "60 * 3 = 180 km.\n#### 180"},
]  # fmt: skip
DEMO_GPQA = [
    {"Question": "Which particle carries no electric charge?", "choice1": "proton", "choice2": "neutron",
     "choice3": "electron", "choice4": "positron", "answer": "(B)"},
    {"Question": "What is the SI unit of force?", "choice1": "joule", "choice2": "watt", "choice3": "newton",
     "choice4": "pascal", "answer": "(C)"},
]  # fmt: skip
DEMO_GEN_TOKENS = 8


def _demo_tasks(root: Path) -> Path:
    """Local task YAMLs (JSON is YAML) shaped like lm-eval's gsm8k and gpqa_diamond_cot_zeroshot: the
    same prompts and answer filters, reading the demo questions from local JSONL files."""
    tasks = root / "tasks"
    tasks.mkdir(parents=True)
    common = {"dataset_path": "json", "test_split": "test", "output_type": "generate_until",
              "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                               "ignore_case": True, "ignore_punctuation": True}]}  # fmt: skip
    configs = {
        "gsm8k": {
            **common,
            "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_target": "{{answer.split('####')[-1].strip()}}",
            "generation_kwargs": {"until": ["Question:", "</s>", "<|im_end|>"], "do_sample": False,
                                  "temperature": 0.0, "max_gen_toks": DEMO_GEN_TOKENS},
            "filter_list": [{"name": "flexible-extract", "filter": [
                {"function": "regex", "group_select": -1, "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)"},
                {"function": "take_first"}]}],
        },
        "gpqa": {
            **common,
            "doc_to_text": "What is the correct answer to this question:{{Question}}\nChoices:\n(A) {{choice1}}\n"
                           "(B) {{choice2}}\n(C) {{choice3}}\n(D) {{choice4}}\nLet's think step by step: ",
            "doc_to_target": "answer",
            "generation_kwargs": {"until": ["</s>"], "do_sample": False, "temperature": 0.0,
                                  "max_gen_toks": DEMO_GEN_TOKENS},
            "filter_list": [{"name": "flexible-extract", "filter": [
                {"function": "multi_choice_regex", "group_select": -1, "ignore_case": True,
                 "ignore_punctuation": True, "regex_pattern": "(\\([A-Z]\\))"},
                {"function": "take_first"}]}],
        },
    }  # fmt: skip
    # lm-eval's gpqa process_docs adds `choices` (its multi_choice_regex filter maps answers to letters by them)
    gpqa = [{**d, "choices": [d[f"choice{i}"] for i in range(1, 5)]} for d in DEMO_GPQA]
    for name, docs in (("gsm8k", DEMO_GSM8K), ("gpqa", gpqa)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        cfg = {
            **configs[name],
            "task": f"dsv4_demo_{name}",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
        }
        (tasks / f"dsv4_demo_{name}.yaml").write_text(json.dumps(cfg, indent=1))
    return tasks


@dataclass
class Row:
    gate: Gate
    task: str
    n: int
    score: float

    @property
    def passed(self) -> bool:
        return self.score >= self.gate.threshold


def evaluate(
    base_url: str, model: str, tokenizer: str, *, demo: bool, limit: int | None, work: Path
) -> tuple[list[Row], dict[str, Any]]:
    """Run every gate against `base_url`; (rows, lm-eval's results by gate name, with samples)."""
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    manager = (
        TaskManager(include_path=str(_demo_tasks(work)), include_defaults=False) if demo else TaskManager()
    )
    rows, raw = [], {}
    for gate in GATES:
        task = f"dsv4_demo_{gate.name}" if demo else gate.task
        chat = gate.model_type == "local-chat-completions"
        args: dict[str, Any] = {
            "model": model,
            "base_url": f"{base_url}/v1/{'chat/completions' if chat else 'completions'}",
            "tokenized_requests": False,  # sglang-router 0.3.2 forwards text prompts only
            "max_retries": 3,
            "num_concurrent": 1 if demo else 16,
        }
        if not chat:  # lm-eval counts and truncates completions prompts with the model's tokenizer
            args |= {"tokenizer": tokenizer, "tokenizer_backend": "huggingface"}
        lm = get_model(gate.model_type)(**args)
        results = simple_evaluate(
            model=lm,
            tasks=[task],
            task_manager=manager,
            num_fewshot=0 if demo else gate.num_fewshot,
            limit=limit,
            apply_chat_template=chat,
            gen_kwargs=None if demo else (gate.gen_kwargs or None),
            log_samples=True,
            bootstrap_iters=0,
        )
        n = len(results["samples"][task])
        rows.append(Row(gate, task, n, float(results["results"][task][gate.metric])))
        raw[gate.name] = results
    return rows, raw


def table(rows: list[Row], *, demo: bool) -> str:
    lines = [
        f"{'gate':6s} {'lm-eval task':28s} {'n':>5s} {'metric':28s} {'score':>7s} {'V4-Flash gate':>13s}  verdict",
    ]
    for r in rows:
        verdict = "not applied (demo model)" if demo else ("pass" if r.passed else "FAIL")
        lines.append(
            f"{r.gate.name:6s} {r.task:28s} {r.n:5d} {r.gate.metric:28s} {r.score:7.3f} "
            f"{r.gate.threshold:13.3f}  {verdict}"
        )
    lines += [f"  {r.gate.name}: threshold from {r.gate.source}" for r in rows]
    return "\n".join(lines)


@contextmanager
def offline(work: Path) -> Iterator[None]:
    """Nothing from the Hub: local datasets only, caches in `work`."""
    saved = {
        k: os.environ.get(k)
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE", "HF_HOME")
    }
    os.environ |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                   "HF_DATASETS_CACHE": str(work / "datasets"), "HF_HOME": str(work / "hf")}  # fmt: skip
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def demo_cluster(model: Path, name: str, work: Path, timeout: float) -> Iterator[str]:
    """`dsv4 up` on the demo checkpoint (examples/cpu-tiny.yaml with this model): yields the router URL
    once the router answers /v1/models, and stops the cluster (SIGTERM: it drains and stops its
    children) on the way out."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    spec = yaml.safe_load((root / "examples" / "cpu-tiny.yaml").read_text())
    spec["spec"]["model"] = {"servedModelName": name, "hostPath": {"path": str(model)}}
    path = work / "demo-spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    log = (work / "up.log").open("w")
    cmd = [
        sys.executable,
        "-m",
        "dsv4_operator.cli",
        "up",
        "-f",
        str(path),
        "--ports",
        "free",
        "--log-dir",
        str(work),
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        url = _wait_endpoint(proc, work / "up.log", timeout)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


def _wait_endpoint(proc: subprocess.Popen[str], log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dsv4 up exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if url is None:
            m = re.search(r"^dsv4 up: endpoint (\S+)", log.read_text(), re.M)
            url = m.group(1).removesuffix("/v1") if m else None
        if url is not None:
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(0.5)  # polling what the cluster reports, bounded by `timeout`
    raise TimeoutError(f"dsv4 up did not serve within {timeout}s:\n{log.read_text()[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", help="the endpoint without /v1 (the router's Service, dsv4 up's URL, ...)")
    p.add_argument("--model", help="the served model name (default: deepseek-v4, or dsv4-demo with --demo)")
    p.add_argument(
        "--tokenizer", help="a checkpoint directory with the tokenizer (default with --demo: the demo)"
    )
    p.add_argument("--demo", action="store_true", help="the demo model and local questions: prove the path")
    p.add_argument("--limit", type=int, help="score only the first N questions of each task")
    p.add_argument("--gate", action="store_true", help="exit 1 when a score is below its threshold")
    p.add_argument("--up-timeout", type=float, default=600.0, help="seconds for --demo's dsv4 up to serve")
    a = p.parse_args(argv)
    if not a.demo and not (a.base_url and a.tokenizer):
        p.error("--base-url and --tokenizer are required without --demo")
    if a.demo and a.gate:
        p.error("--gate applies V4-Flash's thresholds: the demo model cannot meet them")
    model = a.model or ("dsv4-demo" if a.demo else "deepseek-v4")
    with tempfile.TemporaryDirectory(prefix="dsv4-accuracy-") as tmp:
        work = Path(tmp)
        if a.demo:
            from dsv4_engine import demo

            tokenizer = a.tokenizer or str(demo.bundled())
            with offline(work):
                if a.base_url:
                    rows, _ = evaluate(a.base_url, model, tokenizer, demo=True, limit=a.limit, work=work)
                else:
                    with demo_cluster(Path(tokenizer), model, work, a.up_timeout) as url:
                        rows, _ = evaluate(url, model, tokenizer, demo=True, limit=a.limit, work=work)
        else:
            rows, _ = evaluate(a.base_url, model, a.tokenizer, demo=False, limit=a.limit, work=work)
    print(table(rows, demo=a.demo))
    return 1 if a.gate and not all(r.passed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
