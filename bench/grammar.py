"""What the grammar mask costs decode: batch 16, free requests against mixed grammar + free requests
(and all constrained), side by side in one run.

    python bench/grammar.py                  # small preset, 16 requests x 48 decode steps, 3 rounds
    python bench/grammar.py --quick          # tiny preset-sized run: 2 rounds of 24 steps
    python bench/grammar.py --model PATH --threads 1

Each round runs the three workloads back to back on one engine (same prompts, same seeds), so machine
noise hits them alike; the table shows each workload's best and median decode tokens/s over the
rounds and the best's ratio to the free one's best (on a shared machine the best is the least
disturbed), and the time the grammar adds to a step's critical path (waiting for the masks, masking,
advancing the matchers), measured inside the engine. Decode steps are the ones after every request has its first token (the prefill is not
timed). The constrained requests follow a JSON schema with an unbounded string, so they stay inside
the grammar for the whole run; `ignore_eos` keeps every request to the same length. The default
checkpoint is the `small` preset (bench/throughput.py's `default_model`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

from throughput import default_model, prompts_for

SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["text", "n"],
    "additionalProperties": False,
}


class CriticalPath:
    """Seconds the engine thread spends on grammar work: waiting for the masks, and advancing the
    matchers (wrapped around dsv4_engine.grammar's two calls the engine makes in every step)."""

    def __init__(self) -> None:
        from dsv4_engine import grammar

        self.seconds = 0.0
        wait, advance = grammar.PendingMasks.wait, grammar.advance

        def timed(fn):  # type: ignore[no-untyped-def]
            def run(*a, **kw):  # type: ignore[no-untyped-def]
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.seconds += time.perf_counter() - t0

            return run

        grammar.PendingMasks.wait = timed(wait)  # type: ignore[method-assign]
        grammar.advance = timed(advance)


def decode_rate(
    engine: object, prompts: list[list[int]], params: list[object], path: CriticalPath
) -> tuple[float, float]:
    """Decode tokens/s of one workload (the steps after every request has its first token), and the
    grammar's critical-path milliseconds per one of those steps."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]  # type: ignore[attr-defined]
    started: set[str] = set()
    while len(started) < len(ids):
        started |= {o.request_id for o in engine.step()}  # type: ignore[attr-defined]
    tokens, steps, before, t0 = 0, 0, path.seconds, time.perf_counter()
    while engine.has_unfinished():  # type: ignore[attr-defined]
        tokens += sum(len(o.new_token_ids) for o in engine.step())  # type: ignore[attr-defined]
        steps += 1
    return tokens / (time.perf_counter() - t0), (path.seconds - before) / max(steps, 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the small preset, made once)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48, help="decode tokens per request")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds = 24, 2
    if args.threads:
        torch.set_num_threads(args.threads)

    from dsv4_engine.grammar import json_grammar
    from dsv4_engine.llm import LLM
    from dsv4_engine.sampling_params import SamplingParams

    llm = LLM(args.model or default_model(), dtype="float32", max_num_seqs=args.batch, max_model_len=1024)
    engine = llm.engine
    prompts = prompts_for(args.batch, args.prompt_len, args.prompt_len, engine.config.vocab_size, seed=0)
    grammar = json_grammar(SCHEMA)

    def params(constrained: int) -> list[SamplingParams]:
        return [
            SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=args.steps + 1,
                ignore_eos=True,
                grammar=grammar if i < constrained else None,
            )
            for i in range(args.batch)
        ]

    workloads = {
        "free": params(0),
        f"mixed ({args.batch // 2} grammar)": params(args.batch // 2),
        "all grammar": params(args.batch),
    }
    path = CriticalPath()
    decode_rate(engine, prompts, params(args.batch), path)  # warm-up: kernels, llguidance's tokenizer
    rates: dict[str, list[float]] = {name: [] for name in workloads}
    grammar_ms: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(args.rounds):
        for name, ps in workloads.items():
            rate, ms = decode_rate(engine, prompts, ps, path)
            rates[name].append(rate)
            grammar_ms[name].append(ms)
    free = max(rates["free"])
    print(f"\ngrammar mask cost on decode, batch {args.batch}, {args.steps} steps, {args.rounds} rounds")
    print(f"{'workload':<20} {'best tok/s':>10} {'median':>8} {'vs free':>8} {'grammar ms/step':>16}")
    for name, values in rates.items():
        best = max(values)
        ms = statistics.median(grammar_ms[name])
        print(f"{name:<20} {best:>10.1f} {statistics.median(values):>8.1f} {best / free:>8.3f} {ms:>16.2f}")


if __name__ == "__main__":
    main()
