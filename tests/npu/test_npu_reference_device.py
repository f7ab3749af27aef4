"""The reference "npu" device: real tensors on npu:N in host memory, aten ops through one fallback."""

from __future__ import annotations

import os
import threading
from types import ModuleType

import pytest
import torch

# These test the reference itself (device); DSV4_TORCH_NPU=real runs the ops tests on the real torch_npu.
pytestmark = pytest.mark.skipif(
    os.environ.get("DSV4_TORCH_NPU") == "real", reason="tests the reference torch_npu"
)


def test_tensors_live_on_npu_and_flow_through_aten_and_a_reference_op(torch_npu: ModuleType) -> None:
    """The model-free demo: a tensor made on "npu" goes through aten ops and one torch_npu op."""
    x = torch.linspace(-1, 1, 16, device="npu").reshape(2, 8)
    assert x.device == torch.device("npu:0") and x.is_npu
    h = torch.nn.functional.silu(x @ x.T.repeat(1, 4)[:, :8] + 1).to(torch.bfloat16)
    y, rstd = torch_npu.npu_rms_norm(h, torch.ones(8, dtype=torch.bfloat16, device="npu"))
    assert y.device.type == "npu" and rstd.dtype == torch.float32
    ref = h.cpu().float()
    ref = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y.cpu(), ref.to(torch.bfloat16))


def test_data_ptr_storage_and_views_are_real(torch_npu: ModuleType) -> None:
    pool = torch.zeros(4, 6, device="npu")
    row = pool[2]
    assert row.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
    assert row.data_ptr() == pool.data_ptr() + 2 * 6 * 4
    row.add_(7)  # in place through a view
    assert pool.cpu()[2].tolist() == [7.0] * 6 and pool.cpu()[1].tolist() == [0.0] * 6
    # The memory is host memory: a host alias reads and writes the same bytes (what Mooncake sees).
    alias = torch_npu._device.host_alias(pool)
    assert alias.data_ptr() == pool.data_ptr()
    alias[0, 0] = 3.0
    assert pool[0, 0].item() == 3.0


def test_module_to_npu_and_host_round_trip(torch_npu: ModuleType) -> None:
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    want = lin(x)
    lin.to("npu")
    assert lin.weight.device.type == "npu" and isinstance(lin.weight, torch.nn.Parameter)
    got = lin(x.to("npu"))
    assert got.device.type == "npu"
    torch.testing.assert_close(got.cpu(), want)


def test_out_variants_grow_their_output(torch_npu: ModuleType) -> None:
    out = torch.empty(0, device="npu")
    torch.arange(5, out=out)
    assert out.shape == (5,) and out.cpu().tolist() == [0, 1, 2, 3, 4]


def test_mixing_devices_is_refused_like_a_real_backend(torch_npu: ModuleType) -> None:
    x = torch.ones(3, device="npu")
    with pytest.raises(RuntimeError, match="same device"):
        _ = x + torch.ones(3)
    assert (x + torch.tensor(2.0)).cpu().tolist() == [3.0] * 3  # 0-dim host tensors are scalars
    assert x[torch.tensor([0, 2])].device.type == "npu"  # host indices are copied, as with CUDA


def test_memory_info_counts_device_allocations(torch_npu: ModuleType) -> None:
    free0, total = torch.npu.mem_get_info()
    assert total == torch_npu.reference.memory_total
    block = torch.empty(1 << 20, dtype=torch.uint8, device="npu")
    assert torch.npu.mem_get_info()[0] == free0 - (1 << 20)
    del block
    assert torch.npu.mem_get_info()[0] == free0


def test_devices_and_streams(torch_npu: ModuleType) -> None:
    assert torch.npu.is_available() and torch.npu.device_count() >= 1
    torch.npu.set_device(0)
    assert torch.npu.current_device() == 0
    side = torch.npu.Stream()
    assert torch.npu.current_stream() == torch.npu.default_stream()
    with torch.npu.stream(side):
        assert torch.npu.current_stream() == side
        side.wait_stream(torch.npu.default_stream())
    assert torch.npu.current_stream() == torch.npu.default_stream()
    torch.npu.synchronize()


def test_a_thread_without_set_device_makes_an_implicit_context(torch_npu: ModuleType) -> None:
    """The seed's graph-update thread bug: device work before set_device in a new thread."""
    x = torch.ones(2, device="npu")
    before = len(torch_npu.reference.implicit_contexts())

    def careless() -> None:
        _ = x * 2

    def careful() -> None:
        torch.npu.set_device(0)
        _ = x * 2

    for fn, name in ((careful, "careful"), (careless, "careless")):
        t = threading.Thread(target=fn, name=name)
        t.start()
        t.join()
    assert torch_npu.reference.implicit_contexts()[before:] == ["careless"]


def test_a_device_generator_comes_from_the_reference_not_from_torch(torch_npu: ModuleType) -> None:
    """torch's own constructor needs C++ PrivateUse1 hooks (getNewGenerator), which a Python backend
    cannot register; the reference's `torch.Generator` makes one (test_npu_generator.py)."""
    with pytest.raises(RuntimeError, match="getNewGenerator"):
        torch._C.Generator(device="npu")
    assert torch.Generator(device="npu").device == torch.device("npu:0")


def test_the_engine_selects_the_reference_npu(torch_npu: ModuleType) -> None:
    from dsv4_engine.device import npu_available, select_device

    assert npu_available()
    assert select_device("npu") == torch.device("npu")


def test_other_tests_see_no_torch_npu() -> None:
    from dsv4_engine.device import npu_available

    assert not npu_available()
    assert torch.Generator is torch._C.Generator
