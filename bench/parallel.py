"""Tensor and expert parallelism on CPU with gloo: throughput and first-request latency by rank count.

    python bench/parallel.py                      # small preset, ranks 1 2 4, then tp 2 x ep 2
    python bench/parallel.py --quick              # 8 requests x 16 tokens
    python bench/parallel.py --ranks 1 2 --model PATH

For each size, one server's worth of ranks (`LLM(tp_size=N, ep_size=E)`), all in this run:
- generated tokens/s of a batch of requests submitted at once (greedy, prefill included), its
  speedup over one rank and the scaling efficiency (speedup / N);
- the first request's latency (a 1-token completion right after start), with the process groups
  prewarmed and without (`prewarm=False`), and the prewarm's own time;
- how many greedy outputs equal one rank's, and HF's parity on every output (all-reduces reorder
  fp32 sums: a divergence is excused only where HF's top-2 margin is below 1e-4, and counted).
On a machine with fewer cores than ranks the ranks share cores, so the efficiency says what the
parallel split costs here (collectives, duplicated replicated work), not what N devices would give.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from throughput import default_model  # bench/ is the script's directory: on sys.path


def first_request_ms(model: Path, tp: int, ep: int, prewarm: bool, prompt: list[int]) -> tuple[float, float]:
    """(first 1-token request in ms, prewarm seconds) of a fresh server."""
    from dsv4_engine import LLM, SamplingParams

    with LLM(model, dtype="float32", tp_size=tp, ep_size=ep, prewarm=prewarm, max_model_len=2048) as llm:
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        return (time.perf_counter() - t0) * 1e3, llm.engine.prewarm_seconds


def throughput(
    model: Path, tp: int, ep: int, prompts: list[list[int]], tokens: int
) -> tuple[float, list[list[int]]]:
    from dsv4_engine import LLM, SamplingParams

    with LLM(
        model, dtype="float32", tp_size=tp, ep_size=ep, max_model_len=2048, max_num_seqs=len(prompts)
    ) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # one warm step
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="8 requests x 16 tokens")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.tokens = 8, 16
    model = a.model or default_model()
    from dsv4_engine.config import Dsv4Config

    vocab = Dsv4Config.from_pretrained(model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    sizes = [(n, 1) for n in a.ranks] + ([(2, 2)] if 2 in a.ranks else [])
    from dsv4_engine.testing import greedy_divergences, load_hf

    hf = load_hf(model)
    rows, base, base_tps = [], None, None
    for tp, ep in sizes:
        tps, outs = throughput(model, tp, ep, prompts, a.tokens)
        # HF's argmax along each output (teacher-forced): a token may differ only where its top-2
        # margin is below 1e-4 (greedy_divergences raises on any other).
        excused = sum(len(greedy_divergences(hf, p, o)) for p, o in zip(prompts, outs, strict=True))
        warm_ms, prewarm_s = first_request_ms(model, tp, ep, True, prompts[0][:32])
        cold_ms, _ = first_request_ms(model, tp, ep, False, prompts[0][:32])
        if base is None:
            base, base_tps = outs, tps
        same = sum(x == y for x, y in zip(outs, base, strict=True))
        speedup = tps / base_tps
        rows.append((f"tp {tp} ep {ep}", f"{tps:.1f}", f"{speedup:.2f}x", f"{speedup / tp:.0%}",
                     f"{prewarm_s * 1e3:.1f}", f"{warm_ms:.0f}", f"{cold_ms:.0f}", f"{same}/{len(outs)}",
                     str(excused)))  # fmt: skip
        print(f"  done: tp {tp} ep {ep}", flush=True)
    header = ("ranks", "gen tok/s", "vs 1 rank", "efficiency", "prewarm ms", "1st req ms (prewarmed)",
              "1st req ms (not)", "greedy = 1 rank", "excused vs HF")  # fmt: skip
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(
        f"\nmodel {model}, {a.requests} requests x {a.prompt_len} prompt + {a.tokens} tokens, {os.cpu_count()} cores"
    )
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
