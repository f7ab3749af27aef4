"""Offline throughput of the paged continuous-batching engine against HF transformers, one run.

    python bench/throughput.py                 # small preset, 64 requests x 128 tokens, prompts 256..1024
    python bench/throughput.py --quick         # 16 requests x 32 tokens, HF on 2
    python bench/throughput.py --model PATH --threads 1   # default: every core this process may use

Prints one table:
- generated tokens/s of the whole workload (all requests submitted at once, prefill included)
  against HF `generate` run request by request on the first `--hf-requests` (same prompts, greedy);
- prefill tokens/s (the same requests with max_tokens=1), the matmul FLOPs per prompt token that
  implies (counted by torch's FlopCounterMode on a prefill of the first requests) and the achieved
  FLOP/s against this machine's fp32 matmul peak, measured in the same run (a large `torch.mm`);
- decode tokens/s by batch size, from the decode-only steps of the main run.
The default checkpoint is the `small` preset, written once by make_tiny under
`$DSV4_CACHE` (default `~/.cache/dsv4`)/models/small.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def default_model() -> Path:
    root = Path(os.environ.get("DSV4_CACHE", Path.home() / ".cache" / "dsv4"))
    path = root / "models" / "small"
    if not (path / "config.json").exists():
        from dsv4_engine.make_tiny import make_tiny

        print(f"writing the small preset to {path} (once)")
        make_tiny(path, seed=0, preset="small")
    return path


def matmul_peak(n: int, repeats: int) -> float:
    """Best fp32 FLOP/s of an n x n x n torch.mm (the machine's practical matmul peak)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def prompts_for(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def run_engine(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[tuple[int, float]]]:
    """Seconds for the whole workload; (batch size, seconds) of every decode-only step."""
    from dsv4_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    decode_steps: list[tuple[int, float]] = []
    schedule = engine.scheduler.schedule
    last: list = [None]

    def recording():  # type: ignore[no-untyped-def]
        last[0] = out = schedule()
        return out

    engine.scheduler.schedule = recording
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished():
            ts = time.perf_counter()
            engine.step()
            out = last[0]
            if out is not None and all(c.is_decode for c in out.chunks):
                decode_steps.append((len(out.chunks), time.perf_counter() - ts))
    finally:
        engine.scheduler.schedule = schedule
    return time.perf_counter() - t0, decode_steps


def model_flops(model, lengths: list[int]) -> float:
    """Useful (MFU-style) FLOPs of prefilling prompts of these lengths: 2 per weight a token meets
    (every linear it passes, its top-k routed experts only, no lm_head) plus attention over the keys
    it may see (window, HCA rows, CSA's top-k rows) and the indexer's scoring of CSA rows."""
    cfg, m = model.config, model.model
    total = 0.0
    for layer in m.layers:
        attn = layer.self_attn
        dense = sum(
            p.numel()
            for name, p in attn.named_parameters()
            if name.endswith("weight") and p.dim() == 2 and "norm" not in name
        )
        dense += layer.attn_hc.fn.numel() + layer.ffn_hc.fn.numel() + layer.mlp.gate.weight.numel()
        shared = sum(p.numel() for p in layer.mlp.shared_experts.parameters())
        ex = layer.mlp.experts
        routed = cfg.num_experts_per_tok * (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel())
        per_token_weights = dense + shared + routed
        for n in lengths:
            pos = torch.arange(n, dtype=torch.float64)
            keys = torch.clamp(pos + 1, max=attn.window)
            index = torch.zeros_like(pos)
            if attn.ratio == 128:
                keys += torch.floor((pos + 1) / 128)
            elif attn.ratio == 4:
                rows = torch.floor((pos + 1) / 4)
                keys += torch.clamp(rows, max=cfg.index_topk)
                index = 2 * cfg.index_n_heads * cfg.index_head_dim * rows
            attention = 4 * attn.num_heads * attn.head_dim * keys + index
            total += 2 * per_token_weights * n + float(attention.sum())
    total += 2 * m.hc_head.hc_fn.numel() * sum(lengths)
    return total


def prefill_flops_per_token(engine, prompts: list[list[int]]) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    from dsv4_engine.kernels import TorchKernels

    counter = FlopCounterMode(display=False)
    runner, kernels = engine.runner, engine.runner.kernels
    runner.kernels = TorchKernels()  # every aten op: the kernels' inner GEMMs are invisible to the counter
    try:
        with counter:
            run_engine(engine, prompts, 1)  # prefill steps only: they run the runner's set
    finally:
        runner.kernels = kernels
    return counter.get_total_flops() / sum(len(p) for p in prompts)


def run_hf(model_path: Path, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds for HF generate on each prompt alone (greedy, exactly max_tokens new tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:16]]), do_sample=False, max_new_tokens=2)  # warm-up
        t0 = time.perf_counter()
        for p in prompts:
            model.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens
            )
    return time.perf_counter() - t0


def decode_table(steps: list[tuple[int, float]]) -> list[tuple[str, int, float]]:
    """(batch-size range, steps, tokens/s) for decode-only steps grouped by bucket."""
    rows = []
    lo = 1
    for hi in DECODE_BUCKETS:
        group = [(bs, dt) for bs, dt in steps if lo <= bs <= hi]
        if group:
            tokens = sum(bs for bs, _ in group)
            label = f"{lo}" if lo == hi else f"{lo}-{hi}"
            rows.append((label, len(group), tokens / sum(dt for _, dt in group)))
        lo = hi + 1
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="checkpoint folder (default: the small preset, made once)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=256)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-requests", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch intra-op threads, the engine's and HF's alike (default: every core this process may use, "
        "as a server would)",
    )
    p.add_argument("--peak-size", type=int, default=2048, help="n of the n x n x n fp32 peak matmul")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="16 requests x 32 tokens, prompts 256..512, HF on 2")
    a = p.parse_args(argv)
    if a.quick:
        a.num_requests, a.output_len, a.max_prompt, a.hf_requests = 16, 32, 512, 2
    torch.set_num_threads(a.threads)
    model_path = a.model or default_model()
    load = os.getloadavg()

    from dsv4_engine.engine import LLMEngine

    engine = LLMEngine(
        model_path,
        dtype="float32",
        device="cpu",
        max_model_len=a.max_prompt + a.output_len + 128,
        max_num_seqs=a.num_requests,
        max_num_batched_tokens=a.max_num_batched_tokens,
        chunked_prefill_size=a.chunked_prefill_size,
        # Every phase runs the same prompts: with the prefix cache the later ones would resume from
        # the earlier ones, and HF, the reference, prefills every prompt. bench/prefix.py measures it.
        disable_radix_cache=True,
    )
    prompts = prompts_for(a.num_requests, a.min_prompt, a.max_prompt, engine.config.vocab_size, a.seed)
    prompt_tokens = sum(len(x) for x in prompts)
    run_engine(engine, prompts[:2], 2)  # warm-up

    flops_tok = prefill_flops_per_token(engine, prompts[: min(4, len(prompts))])
    useful_tok = model_flops(engine.model, [len(x) for x in prompts]) / prompt_tokens
    # The machine is shared: the peak is measured right before and right after the prefill run
    # and the ratio uses their mean, so both sides see the same load.
    peak_before = matmul_peak(a.peak_size, 5)
    prefill_s, _ = run_engine(engine, prompts, 1)
    peak_after = matmul_peak(a.peak_size, 5)
    total_s, decode_steps = run_engine(engine, prompts, a.output_len)
    hf_s = run_hf(model_path, prompts[: a.hf_requests], a.output_len)

    ours_tps = a.num_requests * a.output_len / total_s
    hf_tps = a.hf_requests * a.output_len / hf_s
    prefill_tps = prompt_tokens / prefill_s
    achieved = prefill_tps * flops_tok
    useful = prefill_tps * useful_tok
    peak = (peak_before + peak_after) / 2

    print(
        f"\nthroughput: {model_path.name}, {a.num_requests} requests, prompts {a.min_prompt}..{a.max_prompt} "
        f"({prompt_tokens} tokens), {a.output_len} output tokens each; fp32 CPU, torch threads {a.threads}, "
        f"load average {load[0]:.2f} / {os.getloadavg()[0]:.2f} (start / end), {os.cpu_count()} CPUs; "
        f"max_num_batched_tokens {engine.max_num_batched_tokens}, prefill chunk {engine.chunked_prefill_size}\n"
    )
    print("| measure | this engine | reference | ratio | target |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| generated tokens/s, whole workload | {ours_tps:.1f} | HF generate one by one "
        f"({a.hf_requests} req): {hf_tps:.1f} | {ours_tps / hf_tps:.1f}x | >= 8x |"
    )
    print(f"| workload seconds | {total_s:.1f} | HF: {hf_s:.1f} for {a.hf_requests} req | | |")
    print(f"| prefill tokens/s (max_tokens=1) | {prefill_tps:.0f} | | | |")
    print(
        f"| prefill model GFLOP/s ({useful_tok / 1e6:.1f} MFLOP/token, MFU-style) | {useful / 1e9:.1f} | "
        f"fp32 mm peak (n={a.peak_size}), mean of {peak_before / 1e9:.0f} before / {peak_after / 1e9:.0f} "
        f"after: {peak / 1e9:.1f} | {100 * useful / peak:.0f}% | >= 50% |"
    )
    print(
        f"| prefill executed matmul GFLOP/s ({flops_tok / 1e6:.1f} MFLOP/token, FlopCounterMode) | "
        f"{achieved / 1e9:.1f} | same peak | {100 * achieved / peak:.0f}% | |"
    )
    for label, n, tps in decode_table(decode_steps):
        print(f"| decode tokens/s, batch {label} ({n} steps) | {tps:.1f} | | | |")
    if decode_steps:
        ms = statistics.median(dt for _, dt in decode_steps) * 1000
        print(f"| median decode step | {ms:.0f} ms | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
