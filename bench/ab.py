"""Same-run A/B of a benchmark between a base commit and the working tree, interleaved, median of N.

    python bench/ab.py --base 322f339 -- bench/decode_vs_hf.py --threads 1
    python bench/ab.py --base HEAD~3 --rounds 5 --only "this engine" -- bench/throughput.py --quick

The base is checked out once as a git worktree (under $DSV4_CACHE, default ~/.cache/dsv4, /ab/<sha>)
and runs its own copy of the benchmark script with its own `engine/` and `operator/` first on
PYTHONPATH; the working tree runs as it is (BENCH.py is a path relative to the repository root).
Rounds alternate base, new, base, new, ... so both see the same machine. Every numeric cell of the
benchmark's table rows (markdown `| a | b |` or `a | b |` lines) is collected per round; the table
printed here gives each cell's median for both and their speed ratio: new / base for rates
(tok/s, GFLOP/s, x), base / new for times (a header or cell in ms or seconds), so > 1 means the new
code is faster either way.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def worktree(base: str) -> Path:
    sha = subprocess.run(["git", "rev-parse", base], cwd=ROOT, capture_output=True, text=True, check=True)
    sha_s = sha.stdout.strip()
    where = Path(os.environ.get("DSV4_CACHE", Path.home() / ".cache" / "dsv4")) / "ab" / sha_s[:12]
    if not (where / ".git").exists():
        where.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(where), sha_s], cwd=ROOT, check=True)
    return where


def is_time(text: str) -> bool:
    """Whether a header or cell measures time (lower is better): ms, seconds, per token."""
    text = text.lower()
    return "/s" not in text and bool(re.search(r"\bms\b|seconds|\d\s*s\b|/token", text))


def cells(output: str) -> dict[tuple[str, str], tuple[float, bool]]:
    """(row name, column header) -> (first number in the cell, whether it is a time) for every row
    of every table in the output (a row without numbers is the header of the rows below it)."""
    out: dict[tuple[str, str], tuple[float, bool]] = {}
    headers: list[str] = []
    for line in output.splitlines():
        if "|" not in line or set(line.strip()) <= set("|-: "):
            continue
        raw = line.rstrip()
        parts = raw.split("|")
        parts = parts[1:] if raw.startswith("|") else parts  # markdown rows open with a bar
        parts = [p.strip() for p in (parts[:-1] if raw.endswith("|") else parts)]
        name, rest = parts[0], parts[1:]
        numbers = [NUMBER.search(c) for c in rest]
        if not any(numbers):
            headers = rest
            continue
        for i, (m, text) in enumerate(zip(numbers, rest, strict=True)):
            header = headers[i] if i < len(headers) else f"column {i + 1}"
            if m is not None:
                out[(name, header)] = (float(m.group()), any(map(is_time, (header, text, name))))
    return out


def run(command: list[str], tree: Path) -> str:
    """The benchmark as `tree` has it (its script, its engine), from the repository root."""
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    if tree != ROOT:
        paths = [str(tree / d) for d in ("engine", "operator")]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    script = tree / command[0]
    proc = subprocess.run(
        [sys.executable, str(script), *command[1:]], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit to compare against (any git revision)")
    p.add_argument("--new", help="the commit to measure (default: the working tree as it is)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", default="", help="report only cells whose 'row | column' matches this regex")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- BENCH.py [its arguments]")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("give the benchmark after --")
    base = worktree(a.base)
    new_tree = worktree(a.new) if a.new else ROOT
    runs: dict[str, list[dict[tuple[str, str], tuple[float, bool]]]] = {"base": [], "new": []}
    for r in range(a.rounds):
        for side, tree in (("base", base), ("new", new_tree)):
            runs[side].append(cells(run(command, tree)))
            print(f"round {r + 1}/{a.rounds} {side} done", file=sys.stderr, flush=True)
    every = runs["base"] + runs["new"]
    keys = [k for k in runs["new"][0] if all(k in v for v in every) and re.search(a.only, " | ".join(k))]
    new_name = a.new or "the working tree"
    print(f"\nA/B: {' '.join(command)}; base {a.base}, new {new_name}; median of {a.rounds}, interleaved\n")
    print("| row | column | base | new | speed, new vs base |")
    print("|---|---|---:|---:|---:|")
    for key in keys:
        old = statistics.median(v[key][0] for v in runs["base"])
        new = statistics.median(v[key][0] for v in runs["new"])
        if old == 0 or new == 0:
            ratio = "n/a"
        else:
            ratio = f"{old / new:.3f}" if runs["new"][0][key][1] else f"{new / old:.3f}"
        print(f"| {key[0]} | {key[1]} | {old:g} | {new:g} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
