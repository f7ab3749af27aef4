"""quant.py: FP8 block and FP4 e2m1 formats, their inverses, and the nibble order."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine import quant


def test_fp4_nibble_order_low_first() -> None:
    # byte 0x2A: low nibble 0xA = sign + code 2 = -1.0, high nibble 0x2 = +1.0
    packed = torch.tensor([[0x2A, 0x7F]], dtype=torch.uint8).view(torch.int8)
    assert quant.unpack_fp4(packed).tolist() == [[-1.0, 1.0, -6.0, 6.0]]


def test_fp4_representable_values_round_trip_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (6, 64), generator=g)
    values = torch.tensor(quant.E2M1_VALUES)[codes]
    values[:, ::32] = 6.0  # pin each group's max so the chosen scale is exactly the one used
    scales = torch.exp2(torch.randint(-4, 4, (6, 2), generator=g).float())
    w = values * scales.repeat_interleave(32, dim=1)
    packed, scale = quant.quant_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (6, 32)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (6, 2)
    assert torch.equal(quant.dequant_fp4(packed, scale), w)


def test_fp4_error_bounded_by_half_a_step() -> None:
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(1))
    back = quant.dequant_fp4(*quant.quant_fp4(w))
    group_max = w.abs().view(16, 3, 32).amax(-1).repeat_interleave(32, dim=1)
    # the widest e2m1 gap is 2 (4 -> 6) in units of scale, and scale <= 2 * amax / 6
    assert bool(((back - w).abs() <= group_max / 3 + 1e-6).all())


def test_fp8_partial_blocks_and_power_of_two_scales() -> None:
    w = torch.randn(200, 130, generator=torch.Generator().manual_seed(2)) * 3
    q, scale = quant.quant_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 2)
    s = quant.scale_to_float(scale)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    back = quant.dequant_fp8_block(q, scale)
    assert back.shape == w.shape
    block_max = torch.zeros(256, 256)
    block_max[:200, :130] = w.abs()
    block_max = block_max.view(2, 128, 2, 128).amax(dim=(1, 3))
    bound = block_max.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :130] * 2**-4
    assert bool(((back - w).abs() <= bound).all())


def test_fp8_exact_values_round_trip() -> None:
    w = torch.tensor([[448.0, -0.5, 1.125, 0.0], [3.0, -2.0, 0.015625, 7.0]])
    assert torch.equal(quant.dequant_fp8_block(*quant.quant_fp8_block(w)), w)


def test_raw_uint8_exponents_equal_e8m0() -> None:
    raw = torch.tensor([[120, 127, 130]], dtype=torch.uint8)
    assert torch.equal(quant.scale_to_float(raw), quant.scale_to_float(raw.view(torch.float8_e8m0fnu)))
    assert quant.scale_to_float(raw).tolist() == [[2.0**-7, 1.0, 8.0]]


def test_mismatched_scales_are_refused_with_expected_shape() -> None:
    q, _ = quant.quant_fp8_block(torch.ones(256, 128))
    with pytest.raises(ValueError, match=r"expected \(2, 1\)"):
        quant.dequant_fp8_block(q, torch.ones(1, 1))
    packed, _ = quant.quant_fp4(torch.ones(4, 64))
    with pytest.raises(ValueError, match=r"expected \(4, 2\)"):
        quant.dequant_fp4(packed, torch.ones(4, 3))
