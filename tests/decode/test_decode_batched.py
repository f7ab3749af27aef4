"""The batched static-buffer decode step against the reference SeqCache decode, on twin paged memories.

Both memories allocate identically (same allocator calls), so they hold the same slots; one decodes
through `PagedSeqCache` (per-request loop), the other through `DecodeGraphRunner` (one forward from
the bucket's `DecodeBuffers`). Both get the reference's greedy tokens, so they see the same inputs.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.graph_runner import DecodeGraphRunner
from dsv4_engine.kernels import choose_kernels

TOL = 1e-5
POOLS = ("swa_kv", "c4_kv", "c128_kv", "indexer_kv", "c4_state", "c4_index_state", "c128_state")
# step -> (joining {name: prompt length}, leaving [names]). Prompt lengths put requests just before
# the window (16), ratio-4, ratio-128 (128, 256, 384) boundaries, and at position 0.
SCHEDULE: dict[int, tuple[dict[str, int], list[str]]] = {
    0: ({"a": 125, "b": 3}, []),
    10: ({"c": 250, "d": 14}, []),
    20: ({}, ["b"]),
    30: ({"e": 1, "f": 126, "g": 300}, []),
    50: ({}, ["a", "c", "d"]),
    60: ({"h": 380}, []),
    70: ({}, ["e", "f", "g"]),
    85: ({"a2": 61}, []),
}
STEPS = 100


@pytest.mark.parametrize("fast", [True, False], ids=["kernels+trim", "static (the form graphs capture)"])
def test_batched_decode_equals_reference_over_changing_batches(model, make_mem, fast: bool) -> None:
    ref, bat = make_mem(), make_mem()
    free0 = bat.free_counts()
    kernels = choose_kernels(model.device, enabled=fast)
    runner = DecodeGraphRunner(
        model, bat.kv, bat.req_pool, 1024, buckets=(1, 2, 4, 8), mode="eager", kernels=kernels, trim=fast
    )
    assert (runner.kernels.name == "cpu") == runner.trim == fast
    ptrs = {k: t.data_ptr() for k, t in runner.static_tensors().items()}
    g = torch.Generator().manual_seed(0)
    next_token: dict[str, int] = {}
    buckets_used: set[int] = set()
    worst = 0.0
    for step in range(STEPS):
        joining, leaving = SCHEDULE.get(step, ({}, []))
        for name in leaving:
            ref.leave(name)
            bat.leave(name)
            del next_token[name]
        for name, n in joining.items():
            prompt = torch.randint(3, 500, (n,), generator=g).tolist()
            first = ref.join(model, name, prompt)
            assert torch.equal(first, bat.join(model, name, prompt))  # same path, same slots
            next_token[name] = int(first.argmax())
        names = list(next_token)
        tokens = [next_token[n] for n in names]
        want = ref.decode_reference(model, names, tokens)
        got = bat.decode_batched(runner, names, tokens)
        buckets_used.add(runner.buffers.bucket_for(len(names)))
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        worst = max(worst, diff)
        assert diff < TOL, f"step {step}, batch {names}: max |logit diff| {diff:.3g}"
        for name, row in zip(names, want, strict=True):
            next_token[name] = int(row.argmax())
    assert buckets_used == {1, 2, 4, 8}
    # Every static buffer (metadata of every bucket, input ids, pools) kept its storage.
    assert {k: t.data_ptr() for k, t in runner.static_tensors().items()} == ptrs
    # The step left exactly the state the reference left: KV, compressed rows, compressor state,
    # and the sentinel page untouched by padding rows.
    for pool in POOLS:
        for layer, want_buf in getattr(ref.kv, pool).items():
            torch.testing.assert_close(getattr(bat.kv, pool)[layer], want_buf, rtol=TOL, atol=TOL)
    for name in list(next_token):
        ref.leave(name)
        bat.leave(name)
    assert bat.free_counts() == free0
    print(f"worst |logit diff| over {STEPS} steps: {worst:.3g}")


def test_padding_rows_keep_sentinel_page_clean(model, make_mem) -> None:
    mem = make_mem()
    runner = DecodeGraphRunner(model, mem.kv, mem.req_pool, 1024, buckets=(4,))
    g = torch.Generator().manual_seed(1)
    mem.join(model, "x", torch.randint(3, 500, (127,), generator=g).tolist())
    for _ in range(3):  # one real row, three padding rows; crosses the c4 and c128 boundary at 127
        mem.decode_batched(runner, ["x"], [7])
    for pool in POOLS:
        for buf in getattr(mem.kv, pool).values():
            if pool.endswith("state"):
                half = buf.shape[-1] // 2
                assert int(torch.count_nonzero(buf[0, :, :half])) == 0
                assert bool(torch.isneginf(buf[0, :, half:]).all())
            else:
                assert int(torch.count_nonzero(buf[0])) == 0, pool


def test_runner_rejects_bad_input(model, make_mem) -> None:
    mem = make_mem()
    with pytest.raises(ValueError, match="decode mode"):
        DecodeGraphRunner(model, mem.kv, mem.req_pool, 1024, mode="fast")  # type: ignore[arg-type]
    runner = DecodeGraphRunner(model, mem.kv, mem.req_pool, 1024, buckets=(1,), mode="graph")
    with pytest.raises(ValueError, match="device graphs need a cuda or npu device"):
        runner.warmup()
    runner = DecodeGraphRunner(model, mem.kv, mem.req_pool, 1024, buckets=(1,))
    mem.join(model, "x", [5, 6])
    mem.join(model, "y", [5, 6])
    with pytest.raises(ValueError, match="largest bucket"):
        mem.decode_batched(runner, ["x", "y"], [1, 2])
