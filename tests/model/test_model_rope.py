"""The RoPE cache: one instance per frequency table, buffers that move with the model, an
index-only decode path, and a clear error when tables are missing on a no-build path."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.config import Dsv4Config, RopeParams
from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch
from dsv4_engine.rope import RopeRegistry, RopeTable, inv_freq, rotate, rotate_
from dsv4_engine.testing import dense_cache


def test_frequencies_match_hf(models) -> None:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    hf = models.hf("A")
    rotary = next(m for m in hf.modules() if isinstance(m, DeepseekV4RotaryEmbedding))
    cfg = Dsv4Config.from_pretrained(models.checkpoints["A"])
    assert cfg.rope_compress.rope_type == "yarn"
    assert torch.equal(inv_freq(cfg.rope_main, cfg.qk_rope_head_dim), rotary.main_inv_freq)
    assert torch.equal(inv_freq(cfg.rope_compress, cfg.qk_rope_head_dim), rotary.compress_inv_freq)


def test_one_instance_per_table_built_once(models) -> None:
    model = models.ours("A")
    registry = model.model.rope
    cfg = model.config
    assert registry.get(cfg.rope_main) is registry.get(cfg.rope_main)
    assert registry.get(cfg.rope_main) is not registry.get(cfg.rope_compress)
    assert len(registry.tables) == 2
    attn = [layer.self_attn for layer in model.model.layers]
    assert all(a.rope is registry.get(cfg.rope_compress if a.ratio else cfg.rope_main) for a in attn)
    assert {t.num_builds for t in registry.tables.values()} == {1}
    with torch.inference_mode():  # a prefill and a decode never build again
        cache = dense_cache(model)
        model(ForwardBatch.build([(cache, [5, 6, 7])]))
        model(ForwardBatch.build([(cache, [8])]))
    assert {t.num_builds for t in registry.tables.values()} == {1}


def test_tables_are_buffers_that_move_with_the_model(checkpoints) -> None:
    model = Dsv4ForCausalLM(Dsv4Config.from_pretrained(checkpoints["A"]), max_positions=64)
    names = {n for n, _ in model.named_buffers()}
    assert any(n.endswith(".cos") for n in names) and any(n.endswith(".sin") for n in names)
    assert not any(k.endswith((".cos", ".sin")) for k in model.state_dict())  # not checkpoint tensors
    table = model.model.rope.get(model.config.rope_main)
    model.to(torch.float64)
    assert table.cos.dtype == torch.float64 and table.lookup(torch.tensor([3]))[0].dtype == torch.float64
    model.to("meta")
    assert table.cos.device.type == "meta" and table.sin.device.type == "meta"


def test_lookup_only_indexes_the_tables() -> None:
    params = RopeParams(theta=10000.0)
    table = RopeTable(params, rope_dim=8, max_positions=32)
    table.build()
    positions = torch.tensor([0, 5, 31, 5])
    cos, sin = table.lookup(positions)
    angles = positions[:, None].float() * inv_freq(params, 8)[None, :]
    assert torch.equal(cos, angles.cos().repeat_interleave(2, -1))
    assert torch.equal(sin, angles.sin().repeat_interleave(2, -1))
    assert cos.data_ptr() != table.cos.data_ptr()  # a gather, not a view that later writes could alias


def test_missing_tables_on_no_build_path_raise() -> None:
    table = RopeTable(RopeParams(theta=10000.0), rope_dim=8, max_positions=16)
    with pytest.raises(RuntimeError, match="missing on a no-build path"):
        table.lookup(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="missing on a no-build path"):
        table.tables(allow_build=False)
    cos, _ = table.tables(allow_build=True)
    assert cos.shape == (16, 8) and table.num_builds == 1


def test_registry_dedups_equal_params() -> None:
    reg = RopeRegistry(rope_dim=8, max_positions=16)
    a = reg.get(RopeParams(theta=10000.0))
    b = reg.get(RopeParams(theta=10000.0))
    c = reg.get(RopeParams(theta=160000.0))
    assert a is b and a is not c and len(reg.tables) == 2


def test_inverse_rotation_undoes_rotation() -> None:
    table = RopeTable(RopeParams(theta=10000.0), rope_dim=8, max_positions=16)
    table.build()
    x = torch.randn(4, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cos, sin = (t.double()[:, None] for t in table.lookup(torch.tensor([0, 3, 7, 15])))
    y = rotate(x, cos, sin)
    assert torch.equal(y[..., :8], x[..., :8])  # only the trailing rope_dim channels turn
    # Exact but for the fp32 table's cos^2 + sin^2 != 1 (~1e-7 of a pair's norm); a wrong inverse is
    # off by O(1). A relative bound alone fails on entries near zero.
    torch.testing.assert_close(rotate(y, cos, -sin), x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_rotation_equals_rotation(dtype: torch.dtype) -> None:
    table = RopeTable(RopeParams(theta=10000.0), rope_dim=8, max_positions=16)
    table.build()
    x = torch.randn(4, 3, 16).to(dtype)
    cos, sin = (t[:, None] for t in table.lookup(torch.tensor([0, 3, 7, 15])))
    for s in (sin, -sin):
        want = rotate(x, cos, s)
        got = x.clone()
        assert rotate_(got, cos, s) is got
        assert torch.equal(got, want)  # bit for bit: the prefill and decode paths share caches


def test_positions_past_the_table_are_refused(models) -> None:
    model = models.ours("A")
    cache = dense_cache(model)
    cache.num_tokens = model.model.rope.max_positions
    with pytest.raises(ValueError, match="max_positions"), torch.inference_mode():
        model(ForwardBatch.build([(cache, [5])]))
