"""Batch-1 greedy decode speed: this engine against HF transformers' `generate`, same checkpoint, same run.

    python bench/decode_vs_hf.py                      # writes a tiny checkpoint to a temp folder
    python bench/decode_vs_hf.py --model PATH --prompt-len 64 --new-tokens 128 --threads 1

Decode tokens/s counts the tokens after the first (the first comes from the prefill), timed over
`--repeats` rounds after one warm-up round, the two implementations interleaved; the best run is reported.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch


def time_ours(model_path: Path, prompt: list[int], new_tokens: int, dtype: str) -> tuple[float, float]:
    """(prefill seconds, decode seconds for new_tokens - 1 tokens) of one request."""
    from dsv4_engine.engine import LLMEngine
    from dsv4_engine.sampling_params import SamplingParams

    engine = _cached(("ours", model_path, dtype), lambda: LLMEngine(model_path, dtype=dtype, device="cpu"))
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()
    t1 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return t1 - t0, time.perf_counter() - t1


def time_hf(model_path: Path, prompt: list[int], new_tokens: int, dtype: str) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    torch_dtype = torch.float32 if dtype in ("auto", "float32") else torch.bfloat16
    model = _cached(
        ("hf", model_path, dtype),
        lambda: AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype).eval(),
    )
    ids = torch.tensor([prompt])

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)
        return time.perf_counter() - t0

    prefill = run(1)
    return prefill, max(run(new_tokens) - prefill, 1e-9)


_CACHE: dict[tuple, object] = {}


def _cached(key: tuple, make):  # type: ignore[no-untyped-def]
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="checkpoint folder (default: a fresh `make_tiny` one)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_path = a.model
        if model_path is None:
            from dsv4_engine.make_tiny import make_tiny

            model_path = make_tiny(Path(tmp) / "tiny", seed=0)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, 500, (a.prompt_len,), generator=g).tolist()
        impls = {"dsv4 engine": time_ours, "HF generate": time_hf}
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in impls}
        for i in range(a.repeats + 1):  # interleaved, so load drift on a shared machine hits both alike
            for name, fn in impls.items():
                result = fn(model_path, prompt, a.new_tokens, a.dtype)
                if i:  # the first round is the warm-up
                    runs[name].append(result)
        rows = []
        for name, results in runs.items():
            prefill = min(r[0] for r in results)
            decode = min(r[1] for r in results)
            rows.append((name, prefill * 1e3, (a.new_tokens - 1) / decode, decode / (a.new_tokens - 1) * 1e3))

    print(
        f"batch-1 greedy decode, prompt {a.prompt_len} tokens, {a.new_tokens} new tokens, "
        f"dtype {a.dtype}, {torch.get_num_threads()} torch thread(s), best of {a.repeats}"
    )
    print(f"{'':<12} | {'prefill ms':>10} | {'decode tok/s':>12} | {'ms/token':>8}")
    print(f"{'-' * 12}-+-{'-' * 10}-+-{'-' * 12}-+-{'-' * 8}")
    for name, prefill_ms, tps, ms in rows:
        print(f"{name:<12} | {prefill_ms:>10.1f} | {tps:>12.1f} | {ms:>8.2f}")
    print(f"ratio (engine / HF decode tok/s): {rows[0][2] / rows[1][2]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
