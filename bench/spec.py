"""Speculative decoding with the MTP layer: decode tokens/s with speculation off and on, one run.

    python bench/spec.py                      # demo model, k = 1 2 3, batch 1 and 8, 96 tokens, 3 repeats,
                                              # then the small preset with a random MTP layer (overhead)
    python bench/spec.py --quick              # k = 2, 32 tokens, 1 repeat, the demo model only (< 60 s)
    python bench/spec.py --model PATH --steps 1 2 --batches 1 --max-tokens 128

The engine runs in this process (`LLM`), one engine per setting (`speculative_num_steps` 0, then each
k), all loaded up front with the prefix cache off (every repeat sends the same prompts). The prompts
are the starts of Python's help topics (`pydoc_data.topics`, the demo model's training text),
`--prompt-tokens` tokens each; every request is greedy with `ignore_eos` and exactly `--max-tokens`
output tokens. Per repeat the settings run in turn, the order reversed every other repeat (damps load
drift on a shared machine).

Per setting and batch size: decode tokens/s (tokens after each request's first / the time from the
step that gave every request its first token to the last step; prefill left out), the median over
repeats, and its ratio to speculation off; from the engine's `metrics()` counters before and after each
run, the mean acceptance length (1 + accepted / drafts: tokens a request gains per verify step) and the
acceptance rate (accepted / draft tokens); and whether every request's greedy tokens equal those
without speculation (MISMATCH otherwise, with the first request and position that differ). Goal:
>= 1.6x decode tokens/s at batch 1 on the demo model, printed beside the table.

Writes runs.csv (one row per run) and steps.csv (tokens a request got per decode step, counted over
every run of a setting: with speculation, the distribution behind the mean acceptance length; off, 1
each) into `--out-dir`. The checkpoint must carry an MTP layer (`num_nextn_predict_layers` >= 1);
tests/speculative_util.py writes a copy of the demo with a random one (acceptance ~0: the ratios then
measure speculation's overhead).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "engine" / "dsv4_engine" / "data" / "demo"
GOAL_RATIO = 1.6  # decode tokens/s, best k against off, batch 1, demo model
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
LOW_ACCEPTANCE = 0.05  # below this the MTP layer is as good as random: say so


# ---- checkpoints -------------------------------------------------------------------------------


def mtp_layers(path: Path) -> int:
    return int(json.loads((path / "config.json").read_text()).get("num_nextn_predict_layers") or 0)


def checkpoint_tensors(path: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as handle:
            names += list(handle.keys())
    return names


def small_preset() -> Path:
    """The small preset with a random MTP layer, written once under `$DSV4_CACHE`/models/small-mtp.
    Its drafts are random, so it measures what speculation costs when nearly nothing is accepted."""
    from dsv4_engine.make_tiny import make_tiny

    root = Path(os.environ.get("DSV4_CACHE", Path.home() / ".cache" / "dsv4")) / "models"
    path = root / "small-mtp"
    if (path / "config.json").exists() and any(n.startswith("mtp.") for n in checkpoint_tensors(path)):
        return path
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:  # written aside, so a cut-off write is never read
        print("writing the small preset with a random MTP layer ...", flush=True)
        probe = make_tiny(Path(tmp) / "small", seed=0, preset="small", mtp=True)
        shutil.rmtree(path, ignore_errors=True)
        probe.rename(path)
    return path
    # Written aside and kept only if it carries the layer: make_tiny may learn to draw one later.
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        print(
            "writing the small preset with num_nextn_predict_layers 1 (kept if it has an MTP layer) ...",
            flush=True,
        )
        probe = make_tiny(
            Path(tmp) / "small", seed=0, preset="small", overrides={"num_nextn_predict_layers": 1}
        )
        if not any(n.startswith("mtp.") for n in checkpoint_tensors(probe)):
            return (
                None,
                "make_tiny's presets carry no MTP layer (num_nextn_predict_layers 1 writes no mtp.* tensors)",
            )
        shutil.rmtree(path, ignore_errors=True)
        probe.rename(path)
    return path, ""


# ---- workload ----------------------------------------------------------------------------------


def corpus_prompts(tokenizer: Any, n: int, tokens: int) -> list[list[int]]:
    """The first `tokens` tokens of `n` help topics, spread over the sorted topic names."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    names = sorted(topics)
    step = max(1, len(names) // n)
    out = []
    for name in names[::step][:n]:
        # A few characters per token: a slice long enough, and no warning about the whole topic's length.
        ids = tokenizer.encode(topics[name].strip()[: 16 * tokens])
        out.append(ids[:tokens])
    return out


@dataclass
class Run:
    model: str
    batch: int
    k: int  # draft tokens per step; 0: off
    rep: int
    wall_s: float
    decode_s: float
    decode_tokens: int
    outputs: list[list[int]]  # per request, in prompt order
    counters: dict[str, float]  # engine.metrics() spec_decode deltas
    per_step: Counter[int] = field(default_factory=Counter)  # tokens a request got per decode step

    @property
    def tok_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def run_once(
    llm: Any, prompts: list[list[int]], max_tokens: int
) -> tuple[float, float, int, list[list[int]], dict[str, float], Counter[int]]:
    """(wall s, decode s, decode tokens, outputs, spec_decode counter deltas, tokens per decode step)."""
    from dsv4_engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.metrics()
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    per_step: Counter[int] = Counter()
    t0 = time.perf_counter()
    t_first: float | None = None
    while engine.has_unfinished():
        for out in engine.step():
            if tokens[out.request_id] and out.new_token_ids:  # a decode step (the first token is prefill's)
                per_step[len(out.new_token_ids)] += 1
            tokens[out.request_id].extend(out.new_token_ids)
        if t_first is None and all(tokens.values()):
            t_first = time.perf_counter()
    end = time.perf_counter()
    after = engine.metrics()
    outputs = [tokens[i] for i in ids]
    decode_tokens = sum(len(o) - 1 for o in outputs)
    decode_s = end - (t_first if t_first is not None else end)
    deltas = {k: float(after.get(k, 0.0)) - float(before.get(k, 0.0)) for k in COUNTERS}
    return end - t0, decode_s, decode_tokens, outputs, deltas, per_step


def bench_model(label: str, path: Path, a: argparse.Namespace) -> list[Run]:
    """Every setting at every batch size, `--repeat` times, on one checkpoint."""
    from dsv4_engine.llm import LLM

    settings = [0, *a.steps]
    batches = sorted(set(a.batches))
    prompts: list[list[int]] | None = None
    llms: dict[int, Any] = {}
    for k in settings:
        print(f"{label}: loading the engine, speculation {name_of(k)} ...", flush=True)
        llms[k] = LLM(
            str(path),
            dtype=a.dtype,
            device=a.device,
            speculative_num_steps=k,
            disable_radix_cache=True,
            max_num_seqs=max(batches),
            max_model_len=a.prompt_tokens + a.max_tokens + 64,
        )
        if prompts is None:
            prompts = corpus_prompts(llms[k].tokenizer, max(batches), a.prompt_tokens)
        for batch in batches:  # warm-up: the first steps of each shape pay one-off costs
            run_once(llms[k], prompts[:batch], 8)
    assert prompts is not None
    runs: list[Run] = []
    for rep in range(a.repeat):
        order = settings if rep % 2 == 0 else settings[::-1]
        for batch in batches:
            for k in order:
                print(
                    f"{label}, repeat {rep + 1}/{a.repeat}: batch {batch}, speculation {name_of(k)} ...",
                    flush=True,
                )
                wall, decode_s, n, outputs, deltas, per_step = run_once(
                    llms[k], prompts[:batch], a.max_tokens
                )
                runs.append(Run(label, batch, k, rep, wall, decode_s, n, outputs, deltas, per_step))
    for llm in llms.values():
        llm.close()
    return runs


# ---- report ------------------------------------------------------------------------------------


def name_of(k: int) -> str:
    return "off" if k == 0 else f"k={k}"


@dataclass
class Row:
    model: str
    batch: int
    k: int
    tok_per_s: float  # median over repeats
    spread: tuple[float, float]  # min, max over repeats
    ratio: float  # to off at the same batch
    mean_length: float  # 1 + accepted / drafts; NaN when off
    acceptance: float  # accepted / draft tokens; NaN when off
    mismatch: str  # "" when every output equals off's


def first_difference(got: Sequence[list[int]], want: Sequence[list[int]]) -> str:
    """'' when equal, else which request differs first and where."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            at = next((j for j, (x, y) in enumerate(zip(g, w, strict=False)) if x != y), min(len(g), len(w)))
            return f"request {i}, token {at}"
    return ""


def rows_of(runs: Sequence[Run]) -> list[Row]:
    from dsv4_engine.server.metrics import spec_decode_acceptance_rate, spec_decode_mean_acceptance_length

    rows = []
    models = list(dict.fromkeys(r.model for r in runs))  # in the order measured
    for model, batch in sorted({(r.model, r.batch) for r in runs}, key=lambda x: (models.index(x[0]), x[1])):
        group = [r for r in runs if r.model == model and r.batch == batch]
        reference = next(r for r in group if r.k == 0 and r.rep == 0).outputs
        off = statistics.median(r.tok_per_s for r in group if r.k == 0)
        for k in sorted({r.k for r in group}):
            mine = [r for r in group if r.k == k]
            totals = {c: sum(r.counters[c] for r in mine) for c in COUNTERS}
            diffs = [d for r in mine if (d := first_difference(r.outputs, reference))]
            median = statistics.median(r.tok_per_s for r in mine)
            rows.append(
                Row(
                    model,
                    batch,
                    k,
                    median,
                    (min(r.tok_per_s for r in mine), max(r.tok_per_s for r in mine)),
                    median / off,
                    spec_decode_mean_acceptance_length(totals) if k else float("nan"),
                    spec_decode_acceptance_rate(totals) if k else float("nan"),
                    f"MISMATCH in {len(diffs)} of {len(mine)} runs, e.g. {diffs[0]}" if diffs else "",
                )
            )
    return rows


def table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| model | batch | speculation | decode tok/s (min-max) | vs off | mean acceptance length | acceptance rate | greedy outputs |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        length = "" if r.k == 0 else f"{r.mean_length:.2f}"
        rate = "" if r.k == 0 else f"{100 * r.acceptance:.1f}%"
        outputs = "reference" if r.k == 0 else r.mismatch or "equal to off"
        lines.append(
            f"| {r.model} | {r.batch} | {name_of(r.k)} | {r.tok_per_s:.1f} ({r.spread[0]:.1f}-{r.spread[1]:.1f}) | "
            f"{r.ratio:.2f}x | {length} | {rate} | {outputs} |"
        )
    return lines


def goal(rows: Sequence[Row], model: str, is_demo: bool) -> str:
    mine = [r for r in rows if r.model == model and r.batch == 1 and r.k > 0]
    if not mine:
        return (
            f"goal: >= {GOAL_RATIO}x decode tok/s at batch 1 on the demo model: not measured (no batch 1 run)"
        )
    best = max(mine, key=lambda r: r.ratio)
    verdict = "PASS" if best.ratio >= GOAL_RATIO else "MISS"
    where = "" if is_demo else f" (measured on {model}, not the bundled demo)"
    return (
        f"goal: >= {GOAL_RATIO}x decode tok/s at batch 1 on the demo model{where}: best {name_of(best.k)} "
        f"{best.ratio:.2f}x {verdict}"
    )


def write_csv(out: Path, runs: Sequence[Run]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "runs.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "model",
                "batch",
                "k",
                "rep",
                "wall_s",
                "decode_s",
                "decode_tokens",
                "decode_tok_per_s",
                *COUNTERS,
            ]
        )
        for r in runs:
            w.writerow(
                [
                    *(r.model, r.batch, r.k, r.rep, f"{r.wall_s:.4f}", f"{r.decode_s:.4f}", r.decode_tokens),
                    f"{r.tok_per_s:.2f}",
                    *(int(r.counters[c]) for c in COUNTERS),
                ]
            )
    with (out / "steps.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "batch", "k", "tokens_per_step", "steps"])
        totals: dict[tuple[str, int, int], Counter[int]] = {}
        for r in runs:
            totals.setdefault((r.model, r.batch, r.k), Counter()).update(r.per_step)
        for (model, batch, k), counts in totals.items():
            for n in sorted(counts):
                w.writerow([model, batch, k, n, counts[n]])


# ---- main --------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", type=Path, default=DEMO, help="checkpoint with an MTP layer (default: the bundled demo)"
    )
    p.add_argument(
        "--steps", type=int, nargs="+", default=[1, 2, 3], help="k: draft tokens per step, each a setting"
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="requests decoded together")
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens of every request")
    p.add_argument("--prompt-tokens", type=int, default=48, help="tokens of each prompt")
    p.add_argument("--repeat", type=int, default=3, help="runs per setting and batch size (median reported)")
    p.add_argument("--no-small", action="store_true", help="skip the small preset")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: the demo model's steps take milliseconds, and spinning "
        "intra-op threads on a shared machine make them many times slower)",
    )
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "out" / "spec")
    p.add_argument("--quick", action="store_true", help="k = 2, 32 tokens, one repeat, no small preset")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.max_tokens, a.repeat, a.no_small = [2], 32, 1, True
    if any(k < 1 for k in a.steps):
        p.error("--steps: every k must be >= 1 (off is always measured)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if mtp_layers(a.model) < 1:
        print(
            f"{a.model} has no MTP layer (num_nextn_predict_layers 0): pass --model with a checkpoint that "
            "has one (tests/speculative_util.py adds a random one to the demo: add_random_mtp)"
        )
        return 2
    import torch

    torch.set_num_threads(a.threads)
    t0, load = time.monotonic(), os.getloadavg()
    is_demo = a.model.resolve() == DEMO.resolve()
    label = "demo" if is_demo else a.model.name
    runs = bench_model(label, a.model, a)
    small_note = "small preset: skipped (--no-small)" if a.no_small else ""
    if not a.no_small:
        runs += bench_model("small", small_preset(), a)
    write_csv(a.out_dir, runs)
    rows = rows_of(runs)
    print(
        f"\nspec: {label} ({a.model}), prompts {a.prompt_tokens} tokens of help topics, {a.max_tokens} output "
        f"tokens each (greedy, ignore_eos), {a.repeat} repeat(s); {a.device} {a.dtype}, torch threads "
        f"{a.threads}, load average {load[0]:.2f} / {os.getloadavg()[0]:.2f} (start / end), "
        f"{os.cpu_count()} CPUs; {time.monotonic() - t0:.0f} s\n"
    )
    print("\n".join(table(rows)))
    print()
    print(goal(rows, label, is_demo))
    if small_note:
        print(small_note)
    for model in dict.fromkeys(r.model for r in rows):
        spec = [r for r in rows if r.model == model and r.k > 0]
        if spec and max(r.acceptance for r in spec) < LOW_ACCEPTANCE:
            print(
                f"note: {model}'s MTP layer keeps under {100 * LOW_ACCEPTANCE:.0f}% of its drafts (an untrained "
                "layer?): these ratios are speculation's overhead, not its gain"
            )
    mismatches = sum(1 for r in rows if r.mismatch)
    if mismatches:
        print(f"MISMATCH: {mismatches} settings' greedy outputs differ from speculation off")
    print(f"raw figures: {a.out_dir / 'runs.csv'}, tokens per verify step: {a.out_dir / 'steps.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
