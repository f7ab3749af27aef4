"""Device and dtype selection; torch_npu is imported only when an NPU is asked for."""

from __future__ import annotations

import sys

import pytest
import torch

from dsv4_engine.device import resolve_dtype, select_device


def test_cpu_and_auto_selection() -> None:
    assert select_device("cpu") == torch.device("cpu")
    assert select_device(torch.device("cpu")) == torch.device("cpu")
    if not torch.cuda.is_available() and "torch_npu" not in sys.modules:
        assert select_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="device"):
        select_device("tpu")


def test_unavailable_accelerators_fail_clearly() -> None:
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda"):
            select_device("cuda")
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="torch_npu"):
            select_device("npu")


def test_dtype_auto_is_fp32_on_cpu_bf16_elsewhere() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", torch.device("cpu"))


def test_cpu_engine_does_not_import_torch_npu(models) -> None:
    models.ours("A")  # a model built and loaded on CPU
    assert "torch_npu" not in sys.modules
