"""`torch.Generator(device="npu")`: torch_npu's Philox generator (NPUGeneratorImpl: a seed and an
offset, a 16-byte state), which the engine seeds per request. The behaviour tests hold for the real
torch_npu too (DSV4_TORCH_NPU=real); the last ones check how the reference provides it."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch


def _draw(generator: torch.Generator, n: int = 8) -> list[float]:
    x = torch.empty(n, device="npu")
    x.exponential_(generator=generator)
    return x.cpu().tolist()


def test_a_device_generator_is_seeded_philox_state(torch_npu: ModuleType) -> None:
    g = torch.Generator(device="npu")
    assert g.device.type == "npu" and isinstance(g, torch.Generator)
    assert g.manual_seed(7) is g and g.initial_seed() == 7 and g.get_offset() == 0
    state = g.get_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu" and state.numel() == 16
    assert int.from_bytes(bytes(state[:8].tolist()), "little") == 7  # the seed, then the offset


def test_draws_repeat_from_a_seed_or_a_saved_state(torch_npu: ModuleType) -> None:
    g = torch.Generator(device="npu").manual_seed(7)
    first = _draw(g)
    assert g.get_offset() > 0 and g.get_offset() % 4 == 0
    saved = g.get_state()
    second = _draw(g)
    assert second != first
    assert _draw(torch.Generator(device="npu").manual_seed(7)) == first
    assert _draw(torch.Generator(device="npu").set_state(saved)) == second  # how PD hands a request over
    assert _draw(torch.Generator(device="npu").manual_seed(8)) != first


def test_set_state_takes_only_the_devices_layout(torch_npu: ModuleType) -> None:
    g = torch.Generator(device="npu")
    seed_only = torch.tensor(list((9).to_bytes(8, "little")), dtype=torch.uint8)
    assert g.set_state(seed_only).initial_seed() == 9 and g.get_offset() == 0
    with pytest.raises(RuntimeError, match="wrong size"):
        g.set_state(torch.zeros(5056, dtype=torch.uint8))  # a CPU generator's state
    with pytest.raises(RuntimeError, match="ByteTensor"):
        g.set_state(torch.zeros(16, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="multiple of 4"):
        g.set_offset(6)


def test_a_host_generator_cannot_draw_on_the_device(torch_npu: ModuleType) -> None:
    with pytest.raises(RuntimeError, match="Expected a 'npu' device type for generator but found 'cpu'"):
        _draw(torch.Generator().manual_seed(1))


def test_the_reference_gives_torch_its_generator_back(reference_npu: ModuleType) -> None:
    """While the reference is importable, torch.Generator makes NPU generators and is otherwise
    torch's (instance checks accept every generator); uninstall restores torch's class itself."""
    assert torch.Generator is not torch._C.Generator
    assert type(torch.Generator()) is torch._C.Generator and torch.Generator("cpu").device.type == "cpu"
    assert isinstance(torch.default_generator, torch.Generator)
    reference_npu._generator.uninstall()
    try:
        assert torch.Generator is torch._C.Generator
    finally:
        reference_npu._generator.install()
