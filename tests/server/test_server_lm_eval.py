"""lm-eval 0.4.13's `local-completions` model (the real client, in-process) against the server on the real
engine: a loglikelihood multiple-choice task and a `generate_until` task, both from a local task YAML and
a local JSONL dataset (nothing is downloaded). Its loglikelihoods equal the engine's own prompt logprobs
for the same token ids, and its generations equal the engine's greedy output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsv4_engine.server.app import create_app

NAME = "dsv4-tiny"


def test_lm_eval_local_completions(llm: Any, tiny_checkpoint: Path, serve: Any, lm_eval: Any) -> None:
    from dsv4_engine.server.args import ServerSettings

    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME)
    with serve(create_app(settings, lambda: llm.engine)) as base:
        # token-id prompts, 4 in one request, as MMLU runs send them
        results, lm = lm_eval.run(base, NAME, tiny_checkpoint, batch_size=4)
    lm_eval.check(results, lm, llm)
