"""lm-eval 0.4.13's `local-completions` model (the real client, in-process) against the server on the real
engine: a loglikelihood multiple-choice task and a `generate_until` task, both from a local task YAML and
a local JSONL dataset (nothing is downloaded). Its loglikelihoods equal the engine's own prompt logprobs
for the same token ids, and its generations equal the engine's greedy output."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.server.app import create_app

NAME = "dsv4-tiny"
GEN_TOKENS = 6
UNTIL = ["\n\n", "Question:"]

MC_DOCS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "made of paper"], "label": 0},
    {"question": "Two plus two equals", "choices": ["three", "four"], "label": 1},
    {
        "question": "A page of the KV cache holds",
        "choices": ["tokens", "cats", "rain", "nothing"],
        "label": 0,
    },
]
GEN_DOCS = [
    {"question": "Name a colour.", "answer": "blue"},
    {"question": "What does the engine serve?", "answer": "a model"},
]


def _write_tasks(root: Path) -> Path:
    """Two task YAMLs and their JSONL datasets in `root` (absolute paths: lm-eval runs from any cwd)."""
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    mc = {
        "task": "dsv4_local_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(root / "mc.jsonl")}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    gen = {
        "task": "dsv4_local_gen",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(root / "gen.jsonl")}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {
            "until": UNTIL,
            "max_gen_toks": GEN_TOKENS,
            "do_sample": False,
            "temperature": 0,
        },
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    tasks = root / "tasks"
    tasks.mkdir()
    for cfg in (mc, gen):  # JSON is YAML: no yaml.dump quirks
        (tasks / f"{cfg['task']}.yaml").write_text(json.dumps(cfg, indent=1))
    return tasks


@pytest.fixture(scope="module")
def lm_eval_run(
    llm: Any, tiny_checkpoint: Path, serve: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    if not os.environ.get("CI"):  # CI's scripts/setup.sh installs it: there a missing client fails
        pytest.importorskip("lm_eval", reason="lm-eval is not installed (scripts/setup.sh installs it)")
    root = tmp_path_factory.mktemp("lm-eval")
    mp = pytest.MonkeyPatch()
    # No hub: the json builder and the tokenizer are local; any download attempt fails the run.
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.setenv(var, "1")
    mp.setenv("HF_DATASETS_CACHE", str(root / "hf-datasets"))
    mp.setenv("HF_HOME", str(root / "hf-home"))
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    tasks = _write_tasks(root)
    from dsv4_engine.server.args import ServerSettings

    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME)
    try:
        with serve(create_app(settings, lambda: llm.engine)) as base:
            lm = get_model("local-completions")(
                base_url=f"{base}/v1/completions",
                model=NAME,
                tokenizer=str(tiny_checkpoint),
                tokenizer_backend="huggingface",
                batch_size=4,  # token-id prompts in one request, as MMLU runs send them
                max_retries=1,
                max_length=512,
            )
            results = simple_evaluate(
                model=lm,
                tasks=["dsv4_local_mc", "dsv4_local_gen"],
                task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                log_samples=True,
                bootstrap_iters=0,
            )
        yield {"results": results, "lm": lm}
    finally:
        mp.undo()


def test_loglikelihoods_equal_the_engines_prompt_logprobs(lm_eval_run: dict[str, Any], llm: Any) -> None:
    results, lm = lm_eval_run["results"], lm_eval_run["lm"]
    samples = results["samples"]["dsv4_local_mc"]
    assert len(samples) == len(MC_DOCS)
    acc = results["results"]["dsv4_local_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    checked = 0
    for sample in samples:
        doc = sample["doc"]
        assert len(sample["resps"]) == len(doc["choices"])
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            (got, _greedy) = resp[0]
            ctx, cont = lm._encode_pair(context, continuation)  # lm-eval's own token ids for the request
            ref = llm.generate([ctx + cont], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
            entries = ref[0].prompt_logprobs[len(ctx) :]
            assert [e.token_id for e in entries] == cont
            want = sum(e.logprob for e in entries)
            assert math.isfinite(got) and got < 0
            assert got == pytest.approx(want, abs=1e-4), (context, continuation)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in MC_DOCS)


def test_generate_until_equals_the_engines_greedy_output(lm_eval_run: dict[str, Any], llm: Any) -> None:
    results, lm = lm_eval_run["results"], lm_eval_run["lm"]
    samples = results["samples"]["dsv4_local_gen"]
    assert len(samples) == len(GEN_DOCS)
    assert results["results"]["dsv4_local_gen"]["exact_match,none"] in (0.0, 0.5, 1.0)
    for sample in samples:
        (context, gen_kwargs) = sample["arguments"][0]
        assert gen_kwargs["until"] == UNTIL
        ids = lm.tok_encode(context)
        ref = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS))[0].text
        for stop in UNTIL:  # the server stops at the first stop string and leaves it out
            ref = ref.split(stop)[0]
        assert sample["resps"][0][0] == ref
