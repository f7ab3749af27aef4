"""Shared pytest configuration and fixtures (engine imports stay inside fixtures: the operator's
tests must not pull in torch)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `suite`: the allowed skips and the pinned tools
from suite import skips

# torch_npu, if ever present in a CPU environment, breaks `import torch` without this.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

# scripts/test.sh runs the suite on two xdist workers. The unit a worker is handed whole: a file (its
# module fixtures start once), or a tier whose files share a session fixture (tests/cluster: the API
# server, node agent and chart release; tests/kube: the API server). Units are handed out in collection
# order: the cluster tier first (the longest unit, so it does not end the run alone), then the tiers
# that run in-process, and last the tiers that start fleets of servers of their own (tests/up,
# tests/disagg), so that the cluster tier's pods start beside in-process tests, not beside a PD fleet
# on the same two cores. (xdist's own `--dist loadgroup` marks are not honoured under pytest 9: a
# scheduler of ours, xdist's documented hook, does the grouping.)
SHARED_SESSION_TIERS = ("cluster", "kube")
FIRST, LAST = ("cluster",), ("up", "disagg")


def _tier(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else ""


def _unit(nodeid: str) -> str:
    tier = _tier(nodeid)
    return f"tests/{tier}" if tier in SHARED_SESSION_TIERS else nodeid.split("::")[0]


@pytest.hookimpl(optionalhook=True)  # a run without xdist (-p no:xdist) has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    # Units are handed out in collection order (below), not xdist's default of most tests first.
    config.option.loadscopereorder = False
    return ByUnit(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        tier = _tier(item.nodeid)
        return 0 if tier in FIRST else 2 if tier in LAST else 1

    items.sort(key=rank)  # stable: the order within a file stays


_skipped: dict[str, list[str]] = {}  # reason -> test ids
_tiers: dict[str, dict[str, int]] = {}  # tests/<tier> -> outcome -> count


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.setdefault(reason.removeprefix("Skipped: "), []).append(report.nodeid)
    if report.when == "call" or not report.passed:  # one outcome per test: its call, or what ended it
        parts = report.nodeid.split("/")
        tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
        counts = _tiers.setdefault(tier, {})
        counts[report.outcome] = counts.get(report.outcome, 0) + 1


def _disallowed() -> dict[str, list[str]]:
    return {r: ids for r, ids in _skipped.items() if not skips.allowed(r)}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A strict run (the test command's) fails on any skip that is not a hardware one."""
    if skips.strict() and _disallowed() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Every skip, by reason; in a strict run, which of them fail it."""
    tr = terminalreporter
    tr.section("tiers (tests/<tier>: outcomes)")
    for tier, counts in sorted(_tiers.items()):
        tr.write_line(f"{tier:12s} " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())))
    total = sum(len(ids) for ids in _skipped.values())
    tr.section(f"skips: {total} (allowed: tests/suite/skips.py HARDWARE)")
    for reason, ids in sorted(_skipped.items()):
        verdict = "allowed" if skips.allowed(reason) else "NOT ALLOWED" if skips.strict() else "not hardware"
        tr.write_line(f"{len(ids):4d}  {verdict}: {reason}")
        for nodeid in ids[:3]:
            tr.write_line(f"        {nodeid}")
        if len(ids) > 3:
            tr.write_line(f"        ... and {len(ids) - 3} more")
    if skips.strict() and _disallowed():
        tr.write_line(
            f"FAILED: {sum(len(i) for i in _disallowed().values())} skips are not hardware ones and "
            f"{skips.STRICT_ENV} is set: install what they name (scripts/test.sh does)",
            red=True,
            bold=True,
        )


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    from dsv4_engine.testing import one_thread

    with one_thread():
        yield


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The parity checkpoints (dsv4_engine.testing.PARITY_CONFIGS), written once per session, each with
    a random MTP layer (HF and an engine without speculative decoding skip it)."""
    from dsv4_engine.make_tiny import make_tiny
    from dsv4_engine.testing import PARITY_CONFIGS, one_thread

    root = tmp_path_factory.mktemp("dsv4_parity_ckpts")
    with one_thread():
        return {
            name: make_tiny(root / name, seed=i, overrides=o, mtp=True)
            for i, (name, o) in enumerate(PARITY_CONFIGS.items())
        }


@pytest.fixture(scope="session")
def hf_models(checkpoints: dict[str, Path]) -> Callable[[str], Any]:
    """HF transformers' DeepseekV4ForCausalLM of a parity checkpoint, loaded once per session."""
    from dsv4_engine.testing import load_hf

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cache[name] = load_hf(checkpoints[name])
        return cache[name]

    return get


# ---- lm-eval 0.4.13 as a client (tests/server/test_server_lm_eval.py, tests/up) --------------------
class LmEval:
    """A loglikelihood multiple-choice task and a `generate_until` task from local task YAMLs and JSONL
    datasets (nothing is downloaded), run by lm-eval's real `local-completions` model in-process."""

    GEN_TOKENS = 6
    UNTIL: ClassVar[list[str]] = ["\n\n", "Question:"]
    MC_DOCS: ClassVar[list[dict[str, Any]]] = [
        {"question": "The sky on a clear day is", "choices": ["blue", "green", "made of paper"], "label": 0},
        {"question": "Two plus two equals", "choices": ["three", "four"], "label": 1},
        {
            "question": "A page of the KV cache holds",
            "choices": ["tokens", "cats", "rain", "nothing"],
            "label": 0,
        },
    ]
    GEN_DOCS: ClassVar[list[dict[str, Any]]] = [
        {"question": "Name a colour.", "answer": "blue"},
        {"question": "What does the engine serve?", "answer": "a model"},
    ]

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tasks = self._write_tasks()

    def _write_tasks(self) -> Path:
        root = self.root
        for name, docs in (("mc", self.MC_DOCS), ("gen", self.GEN_DOCS)):
            (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        common = {
            "dataset_path": "json",
            "test_split": "test",
            "doc_to_text": "Question: {{question}}\nAnswer:",
        }
        mc = {
            **common, "task": "dsv4_local_mc", "output_type": "multiple_choice",
            "dataset_kwargs": {"data_files": {"test": str(root / "mc.jsonl")}},
            "doc_to_choice": "{{choices}}", "doc_to_target": "label",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        }  # fmt: skip
        gen = {
            **common, "task": "dsv4_local_gen", "output_type": "generate_until",
            "dataset_kwargs": {"data_files": {"test": str(root / "gen.jsonl")}},
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {
                "until": self.UNTIL, "max_gen_toks": self.GEN_TOKENS, "do_sample": False, "temperature": 0,
            },
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        }  # fmt: skip
        tasks = root / "tasks"
        tasks.mkdir()
        for cfg in (mc, gen):  # JSON is YAML: no yaml.dump quirks
            (tasks / f"{cfg['task']}.yaml").write_text(json.dumps(cfg, indent=1))
        return tasks

    def run(
        self, base_url: str, model: str, tokenizer: Path, **model_args: Any
    ) -> tuple[dict[str, Any], Any]:
        """lm-eval's results (with samples) and its model object, offline: any download fails the run."""
        mp = pytest.MonkeyPatch()
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(var, "1")
        mp.setenv("HF_DATASETS_CACHE", str(self.root / "hf-datasets"))
        mp.setenv("HF_HOME", str(self.root / "hf-home"))
        try:
            from lm_eval import simple_evaluate
            from lm_eval.api.registry import get_model
            from lm_eval.tasks import TaskManager

            lm = get_model("local-completions")(
                base_url=f"{base_url}/v1/completions", model=model, tokenizer=str(tokenizer),
                tokenizer_backend="huggingface", max_retries=1, max_length=512, **model_args,
            )  # fmt: skip
            results = simple_evaluate(
                model=lm,
                tasks=["dsv4_local_mc", "dsv4_local_gen"],
                task_manager=TaskManager(include_path=str(self.tasks), include_defaults=False),
                log_samples=True,
                bootstrap_iters=0,
            )
        finally:
            mp.undo()
        return results, lm

    def check(self, results: dict[str, Any], lm: Any, llm: Any) -> None:
        """lm-eval's answers are the engine's (`llm`, an `LLM` on the served checkpoint): every
        loglikelihood the sum of the engine's prompt logprobs over the continuation's own ids, every
        generation its greedy text for lm-eval's ids, cut at the first stop string."""
        import math

        from dsv4_engine.sampling_params import SamplingParams

        samples = results["samples"]["dsv4_local_mc"]
        assert len(samples) == len(self.MC_DOCS)
        assert 0.0 <= results["results"]["dsv4_local_mc"]["acc,none"] <= 1.0
        checked = 0
        for sample in samples:
            assert len(sample["resps"]) == len(sample["doc"]["choices"])
            for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
                got = resp[0][0]
                ctx, cont = lm._encode_pair(context, continuation)  # lm-eval's own ids for the request
                ref = llm.generate(
                    [ctx + cont], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
                )
                entries = ref[0].prompt_logprobs[len(ctx) :]
                assert [e.token_id for e in entries] == cont
                assert math.isfinite(got) and got < 0
                assert got == pytest.approx(sum(e.logprob for e in entries), abs=1e-4), (
                    context,
                    continuation,
                )
                checked += 1
        assert checked == sum(len(d["choices"]) for d in self.MC_DOCS)
        samples = results["samples"]["dsv4_local_gen"]
        assert len(samples) == len(self.GEN_DOCS)
        assert results["results"]["dsv4_local_gen"]["exact_match,none"] in (0.0, 0.5, 1.0)
        greedy = SamplingParams(temperature=0.0, max_tokens=self.GEN_TOKENS)
        for sample in samples:
            (context, gen_kwargs) = sample["arguments"][0]
            assert gen_kwargs["until"] == self.UNTIL
            ref = llm.generate([lm.tok_encode(context)], greedy)[0].text
            for stop in self.UNTIL:  # the server stops at the first stop string and leaves it out
                ref = ref.split(stop)[0]
            assert sample["resps"][0][0] == ref


@pytest.fixture
def lm_eval(tmp_path: Path) -> LmEval:
    if importlib.util.find_spec("lm_eval") is None:
        skips.missing("lm-eval is not installed (scripts/setup.sh installs it)")
    return LmEval(tmp_path)
