"""What each rank holds and computes, in one process: its shard of every weight (read from the
checkpoint, plain and quantised), partial outputs that sum to the whole layer's, sizes that do not
split refused by name, and an allocator that mirrors rank 0's by replaying its journal."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dsv4_engine.make_tiny import make_tiny
from dsv4_engine.memory import Dsv4MemoryLayout, ExtendSpec, OutOfPages, PagedMemory
from dsv4_engine.memory.sizing import fixed_pool_sizes
from dsv4_engine.model import ForwardBatch
from dsv4_engine.parallel import groups
from dsv4_engine.parallel.groups import Parallel
from dsv4_engine.parallel.shard import check_sizes, model_shards
from dsv4_engine.ranks import load_model
from dsv4_engine.testing import dense_cache, one_thread

SIZES = [(2, 1), (4, 1), (2, 2), (4, 2), (4, 4)]


@pytest.fixture(scope="module", params=["none", "fp8", "w8a8"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    with one_thread():
        return make_tiny(tmp_path_factory.mktemp("shards") / request.param, seed=3, quant=request.param)


def _load(path: Path, parallel: Parallel | None = None) -> torch.nn.Module:
    return load_model(path, torch.float32, torch.device("cpu"), 512, parallel or groups.SINGLE)


@pytest.mark.parametrize(("tp", "ep"), SIZES)
def test_each_rank_loads_exactly_its_shard(checkpoint: Path, tp: int, ep: int) -> None:
    full = _load(checkpoint).state_dict()
    split = set()
    for rank in range(tp):
        model = _load(checkpoint, Parallel(rank, tp, ep))
        shards = model_shards(model)
        for name, tensor in model.state_dict().items():
            want = shards[name][1].take(full[name]) if name in shards else full[name]
            assert torch.equal(tensor, want), (rank, name)
        split |= set(shards)
    # Heads, sinks, both output projections, the shared and the routed experts of every layer.
    layers = len(model.model.layers)
    assert len(split) == 9 * layers, sorted(split)


@pytest.mark.parametrize(("tp", "ep"), SIZES)
def test_rank_partials_sum_to_the_whole_layer(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tp: int, ep: int
) -> None:
    """Each rank's attention and MoE output before the all-reduce: summed over the ranks, the whole
    model's (attention heads and o_groups 2 split 2 and 4 ways, experts E ways, I tp/E ways)."""
    monkeypatch.setattr(groups.Parallel, "all_reduce", lambda self, x: x)
    path = checkpoints["A"]
    full = _load(path)
    ranks = [_load(path, Parallel(r, tp, ep)) for r in range(tp)]
    x = torch.randn(40, full.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = [random.Random(1).randrange(full.config.vocab_size) for _ in range(40)]
    with torch.inference_mode():
        for layer in range(len(full.model.layers)):
            outs = []
            for model in [full, *ranks]:
                batch = ForwardBatch.build([(dense_cache(model), ids)])
                for table in model.model.rope.tables.values():
                    batch.memo[id(table)] = table.lookup(batch.positions)
                block = model.model.layers[layer]
                outs.append((block.self_attn(x, batch), block.mlp(x, batch)))
            for part in range(2):
                total = sum(o[part] for o in outs[1:])
                torch.testing.assert_close(total, outs[0][part], rtol=1e-5, atol=1e-5)


def test_sizes_that_do_not_split_are_refused_by_name(checkpoints: dict[str, Path]) -> None:
    config = _load(checkpoints["A"]).config  # 4 heads, o_groups 2, 8 experts, intermediate 128
    check_sizes(config, 4, 4)
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by tp_size 8"):
        check_sizes(config, 8, 1)
    with pytest.raises(ValueError, match="ep_size 3 must divide tp_size 4"):
        check_sizes(config, 4, 3)


def test_a_replayed_journal_mirrors_the_allocator(checkpoints: dict[str, Path]) -> None:
    """Random requests, steps, preallocations and frees on rank 0's allocator; a second one replaying
    its journal holds the same tables and free counts after every batch of changes."""
    config = _load(checkpoints["A"]).config
    layout = Dsv4MemoryLayout.from_config(config, page_size=128, kv_dtype=torch.float32)
    sizes = fixed_pool_sizes(layout, 24, max_reqs=6, max_batched_tokens=256)
    lead, follower = (PagedMemory.build(layout, sizes, 6, 1024, "meta") for _ in range(2))
    lead.allocator.record()
    rng = random.Random(0)
    held: dict[int, int] = {}
    for _ in range(300):
        op = rng.random()
        alloc = lead.allocator
        if op < 0.25 and len(held) < 6:
            row = alloc.alloc_request()
            if row is not None:
                if rng.random() < 0.3:
                    try:
                        n = rng.randrange(1, 900)
                        alloc.alloc_prealloc(row, n)
                        held[row] = n
                    except OutOfPages:
                        alloc.free(row)
                else:
                    held[row] = 0
        elif op < 0.8 and held:
            row = rng.choice(sorted(held))
            end = min(1024, held[row] + rng.randrange(1, 300))
            if end > held[row]:
                try:
                    alloc.alloc_extend([ExtendSpec(row, held[row], end)])
                    held[row] = end
                except OutOfPages:
                    pass
        elif held:
            row = rng.choice(sorted(held))
            alloc.free(row)
            del held[row]
        follower.allocator.replay(alloc.take_journal())
        assert follower.allocator.num_free() == alloc.num_free()
        for name in lead.req_pool.TABLES:
            assert torch.equal(getattr(lead.req_pool, name), getattr(follower.req_pool, name)), name
