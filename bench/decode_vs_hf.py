"""Batch-1 greedy decode speed: this engine against HF transformers' `generate`, same checkpoint, same run.

    python bench/decode_vs_hf.py                      # writes a tiny checkpoint to a temp folder
    python bench/decode_vs_hf.py --model PATH --prompt-len 64 --new-tokens 128 --threads 1
    python bench/decode_vs_hf.py --impls eager,compiled,hf   # only some rows

Rows: `engine` (LLMEngine end to end), `eager` / `compiled` (the batched static-buffer decode step of
`DecodeGraphRunner` over the paged pools, prefill through the reference path; compiled artefacts are
cached under TORCHINDUCTOR_CACHE_DIR, default ~/.cache/dsv4/inductor, and the compile happens in the
untimed warm-up round), `hf` (HF `generate`). Decode tokens/s counts the tokens after the first (the
first comes from the prefill), timed over `--repeats` rounds after one warm-up round, the
implementations interleaved; the best run is reported. The footer gives what bounds the batched step:
ATen ops dispatched per step and the split between metadata refresh and the forward.
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

    # Rounds repeat the prompt: without this its prefill would come from the prefix cache, HF's not.
    engine = _cached(
        ("ours", model_path, dtype),
        lambda: LLMEngine(model_path, dtype=dtype, device="cpu", disable_radix_cache=True),
    )
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()
    t1 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return t1 - t0, time.perf_counter() - t1


class _Batched:
    """One request's paged memory, the model and a DecodeGraphRunner (bucket 1) in `mode`."""

    def __init__(self, model_path: Path, dtype: str, mode: str, max_ctx: int) -> None:
        from dsv4_engine.config import Dsv4Config
        from dsv4_engine.device import resolve_dtype
        from dsv4_engine.graph_runner import DecodeGraphRunner
        from dsv4_engine.loader import load_checkpoint
        from dsv4_engine.memory import (
            Dsv4MemoryLayout,
            PagedMemory,
            PoolSizes,
        )
        from dsv4_engine.model import Dsv4ForCausalLM

        torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
        config = Dsv4Config.from_pretrained(model_path)
        self.model = Dsv4ForCausalLM(config, max_positions=max_ctx).cast(torch_dtype)
        load_checkpoint(self.model, model_path, dtype=None, progress=False)
        self.model.eval()
        layout = Dsv4MemoryLayout.from_config(config, page_size=128, kv_dtype=torch_dtype)
        pages = -(-max_ctx // 128)
        sizes = PoolSizes(full_pages=pages, swa_pages=pages + 2, c4_state_pages=4, c128_state_pages=4)
        mem = PagedMemory.build(layout, sizes, max_reqs=1, max_ctx=max_ctx)
        self.kv, self.req_pool, self.alloc = mem.kv, mem.req_pool, mem.allocator
        self.runner = DecodeGraphRunner(self.model, self.kv, self.req_pool, max_ctx, buckets=(1,), mode=mode)
        self.runner.warmup()
        self.split = [0.0, 0.0, 0]  # metadata refresh seconds, forward seconds, steps

    def __call__(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        from dsv4_engine.attention.paged_extend import paged_extend_batch
        from dsv4_engine.memory import ExtendSpec

        row = self.alloc.alloc_request()
        t0 = time.perf_counter()
        spec = ExtendSpec(row, 0, len(prompt))
        bundle = self.alloc.alloc_extend([spec])
        with torch.inference_mode():
            batch = paged_extend_batch(self.kv, self.req_pool, [spec], bundle, [prompt], self.model.dtype)
            hidden = self.model(batch)
            token = int(self.model.compute_logits(hidden[-1:]).argmax())
        t1 = time.perf_counter()
        pos = len(prompt)
        for _ in range(new_tokens - 1):
            bundle = self.alloc.alloc_decode([row])
            ta = time.perf_counter()
            bs = self.runner.prepare([ExtendSpec(row, pos, pos + 1)], [token], bundle)
            tb = time.perf_counter()
            token = int(self.runner.step(bs)[0][0].argmax())  # (logits, streams): row 0
            self.split[0] += tb - ta
            self.split[1] += time.perf_counter() - tb
            self.split[2] += 1
            pos += 1
        t2 = time.perf_counter()
        self.alloc.free(row)
        return t1 - t0, t2 - t1

    def ops_per_step(self) -> int:
        """ATen ops one eager decode step dispatches (after composite ops decompose)."""
        from torch.utils._python_dispatch import TorchDispatchMode

        class Count(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                Count.n += 1
                return func(*args, **(kwargs or {}))

        with Count():
            self.runner._eager_fn(1)()
        return Count.n


def time_batched(mode: str):  # type: ignore[no-untyped-def]
    def run(model_path: Path, prompt: list[int], new_tokens: int, dtype: str) -> tuple[float, float]:
        max_ctx = -(-(len(prompt) + new_tokens) // 128) * 128
        bench = _cached(
            ("batched", mode, model_path, dtype), lambda: _Batched(model_path, dtype, mode, max_ctx)
        )
        return bench(prompt, new_tokens)

    return run


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
    p.add_argument("--impls", default="engine,eager,compiled,hf", help="rows to run, comma-separated")
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
        known = {
            "engine": ("dsv4 engine", time_ours),
            "eager": ("batched eager", time_batched("eager")),
            "compiled": ("batched compiled", time_batched("compiled")),
            "hf": ("HF generate", time_hf),
        }
        wanted = [name.strip() for name in a.impls.split(",") if name.strip()]
        unknown = sorted(set(wanted) - set(known))
        if unknown or "hf" not in wanted:
            p.error(f"--impls takes {','.join(known)} and must include hf; got {a.impls!r}")
        impls = dict(known[name] for name in wanted)
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
    hf_tps = next(tps for name, _, tps, _ in rows if name == "HF generate")
    print(f"{'':<16} | {'prefill ms':>10} | {'decode tok/s':>12} | {'ms/token':>8} | {'vs HF':>6}")
    print(f"{'-' * 16}-+-{'-' * 10}-+-{'-' * 12}-+-{'-' * 8}-+-{'-' * 6}")
    for name, prefill_ms, tps, ms in rows:
        print(f"{name:<16} | {prefill_ms:>10.1f} | {tps:>12.1f} | {ms:>8.2f} | {tps / hf_tps:>5.2f}x")
    for key, bench in _CACHE.items():
        if key[0] != "batched":
            continue
        meta_s, fwd_s, steps = bench.split  # type: ignore[attr-defined]
        line = (
            f"{key[1]}: per step {1e3 * meta_s / steps:.2f} ms host inputs + "
            f"{1e3 * fwd_s / steps:.2f} ms step (metadata from the tables + forward)"
        )
        if key[1] == "eager":
            ops = bench.ops_per_step()  # type: ignore[attr-defined]
            line += f"; {ops} ATen ops per step, {1e6 * fwd_s / steps / ops:.1f} us each"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
