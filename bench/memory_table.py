"""KV + state bytes one request holds, computed from the paged pools, for DeepSeek-V4-Flash.

For each context length a request is prefilled in page-aligned chunks through the real allocator and
then decodes one token (so the window and state watermarks are in their steady state); the bytes are
the pages it then holds in each family times the bytes one page costs in the pools' buffers. The pools
live on torch's meta device, so nothing of 1M tokens is actually allocated.

It then prices a prefix-cache snapshot (the SWA window and the C4 state a resume at a page boundary
reads) and what the pools of one budget hold with 4-row C4 snapshot slots against whole C4 state
pages per snapshot (the earlier layout).

    python bench/memory_table.py [--page-size 128] [--chunk 8192]
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from dsv4_engine.memory import (
    Dsv4MemoryLayout,
    ExtendSpec,
    PagedMemory,
    PoolSizes,
    StateType,
)
from dsv4_engine.memory.sizing import (
    c4_slot_bytes,
    c4_state_page_bytes,
    fixed_pool_sizes,
    full_page_bytes,
    plan_pool_sizes,
    pool_bytes,
    swa_page_bytes,
    table_bytes,
)
from dsv4_engine.memory.state_tail import cdiv

GIB = 1 << 30
CONTEXTS = (1024, 8192, 65536, 1 << 20)

# The released DeepSeek-V4-Flash config.json (memory-relevant keys; dsv4-model-and-pd.md section 1).
FLASH = {
    "num_hidden_layers": 43,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "head_dim": 512,
    "index_head_dim": 128,
    "sliding_window": 128,
}
V3_LAYERS, V3_ROW = 61, 512 + 64  # DeepSeek-V3 MLA: kv_lora_rank + rope dim per layer per token


@dataclass
class Row:
    context: int
    compressed: int  # C4 + indexer + C128 KV (full pages)
    swa: int
    c4_state: int
    c128_state: int

    @property
    def total(self) -> int:
        return self.compressed + self.swa + self.c4_state + self.c128_state


def held_bytes(layout: Dsv4MemoryLayout, context: int, chunk: int) -> Row:
    """Prefill `context - 1` tokens in chunks, decode one, and price the pages the request holds."""
    p = layout.page_size
    sizes = PoolSizes(
        full_pages=cdiv(context, p), swa_pages=cdiv(chunk, p) + 4, c4_state_pages=8, c128_state_pages=8
    )
    mem = PagedMemory.build(layout, sizes, max_reqs=1, max_ctx=context, device="meta")
    kv, alloc = mem.kv, mem.allocator
    r = alloc.alloc_request()
    done = 0
    while done < context - 1:
        nxt = min(context - 1, done + chunk)
        alloc.alloc_extend([ExtendSpec(r, done, nxt)])
        done = nxt
    alloc.alloc_decode([r])
    held = alloc.held_pages(r)
    full_page = sum(kv.page_bytes(t) for t in (StateType.C4, StateType.INDEXER, StateType.C128))
    return Row(
        context=context,
        compressed=held["full"] * full_page,
        swa=held["swa"] * kv.page_bytes(StateType.SWA),
        c4_state=held["c4s"] * kv.page_bytes(StateType.C4_STATE),
        c128_state=held["c128s"] * kv.page_bytes(StateType.C128_STATE),
    )


def uncompressed_bytes(layout: Dsv4MemoryLayout, context: int) -> int:
    """Same model, every layer keeping its full 512-d latent for every token (16-bit)."""
    return context * layout.num_layers * layout.head_dim * 2


def v3_bytes(context: int) -> int:
    return context * V3_LAYERS * V3_ROW * 2


def gib(n: int) -> str:
    return f"{n / GIB:.3f}"


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def table(page_size: int, chunk: int) -> str:
    bf16 = Dsv4MemoryLayout.from_config(FLASH, page_size=page_size, kv_dtype=torch.bfloat16)
    fp8_idx = Dsv4MemoryLayout.from_config(
        FLASH, page_size=page_size, kv_dtype=torch.bfloat16, index_dtype=torch.float8_e4m3fn
    )
    lines = [
        f"DeepSeek-V4-Flash, page {page_size}, 16-bit KV, fp32 compressor state: bytes one request holds",
        "",
        "| context | C4+indexer+C128 KV (GiB) | SWA KV (MiB) | C4 state (MiB) | C128 state (MiB) "
        "| **V4 total (GiB)** | V4 total, 8-bit indexer (GiB) | uncompressed V4 (GiB) | V3 MLA (GiB) | V3 / V4 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ctx in CONTEXTS:
        a = held_bytes(bf16, ctx, chunk)
        b = held_bytes(fp8_idx, ctx, chunk)
        v3 = v3_bytes(ctx)
        label = f"{ctx // 1024}k" if ctx < (1 << 20) else "1M"
        lines.append(
            f"| {label} | {gib(a.compressed)} | {mib(a.swa)} | {mib(a.c4_state)} | {mib(a.c128_state)} "
            f"| **{gib(a.total)}** | {gib(b.total)} | {gib(uncompressed_bytes(bf16, ctx))} | {gib(v3)} "
            f"| {v3 / a.total:.1f}x |"
        )
    return "\n".join(lines)


def snapshot_table(page_size: int, budget_gib: int, max_reqs: int, max_ctx: int, batched: int) -> str:
    """Bytes per snapshot, and the pools of one budget with `max_reqs` snapshots (the engine's
    `snapshots = max_num_seqs`), slots against whole C4 state pages."""
    layout = Dsv4MemoryLayout.from_config(FLASH, page_size=page_size, kv_dtype=torch.bfloat16)
    swa = cdiv(layout.window, page_size) * swa_page_bytes(layout)
    page, slot = c4_state_page_bytes(layout), c4_slot_bytes(layout)
    budget, kw = budget_gib * GIB, {"max_reqs": max_reqs, "max_batched_tokens": batched}
    now = plan_pool_sizes(layout, budget, max_ctx=max_ctx, snapshots=max_reqs, **kw)
    # The earlier layout: no slots, one more C4 state page per snapshot; the rest to full pages.
    fixed = fixed_pool_sizes(layout, 0, snapshots=max_reqs, **kw)
    fixed = dataclasses.replace(fixed, c4_state_pages=fixed.c4_state_pages + max_reqs, c4_snapshot_slots=0)
    per_full = full_page_bytes(layout)
    before = (budget - pool_bytes(layout, fixed) + per_full - table_bytes(max_reqs, max_ctx)) // per_full - 1
    more = now.full_pages - before
    return "\n".join([
        f"Prefix-cache snapshot, page {page_size}: SWA window {mib(swa)} MiB + C4 state: whole page "
        f"{mib(page)} MiB (total {mib(swa + page)} MiB) -> 4-row slot {mib(slot)} MiB "
        f"(total {mib(swa + slot)} MiB)",
        f"Pools of {budget_gib} GiB, max_num_seqs {max_reqs} (= snapshots), max_ctx {max_ctx}: "
        f"c4 state pages {fixed.c4_state_pages} -> {now.c4_state_pages} + {now.c4_snapshot_slots} slots; "
        f"full pages {before} -> {now.full_pages} (+{more}, +{more * page_size} tokens of context)",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (a multiple of the page size)")
    args = ap.parse_args(argv)
    print(table(args.page_size, args.chunk))
    print()
    print(snapshot_table(args.page_size, budget_gib=64, max_reqs=64, max_ctx=1 << 17, batched=8192))


if __name__ == "__main__":
    main()
