"""`torch_npu` for the tests in tests/npu: the reference (tests/npu/reference) on a CPU, or, with
DSV4_TORCH_NPU=real on an Ascend node, the real torch_npu, so the same assertions check the real ops
against the same host math (docs/npu.md, "Verify on an A3 node").

The reference is importable only inside the tests that ask for it. Its device registration is
process-wide and stays (torch allows one PrivateUse1 rename), but once a test is done `import
torch_npu` fails again, so `dsv4_engine.device.npu_available()` answers False for every other test
in the session, as it does on a machine without torch_npu.

Tests of the reference itself (its device internals, graph recording, and the exact errors it
raises) take `reference_npu`, which the real mode skips: those messages and host-side checks are the
reference's, not the hardware's.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

REFERENCE = str(Path(__file__).parent / "reference")
REAL = os.environ.get("DSV4_TORCH_NPU") == "real"


@contextlib.contextmanager
def _importable() -> Iterator[ModuleType]:
    if REAL:
        yield importlib.import_module("torch_npu")
        return
    sys.path.insert(0, REFERENCE)
    try:
        import torch_npu

        yield torch_npu
    finally:
        sys.path.remove(REFERENCE)
        reference = sys.modules.pop("torch_npu", None)  # its submodules stay: nothing registers twice
        if reference is not None:
            reference._generator.uninstall()  # torch.Generator is torch's own again


@pytest.fixture
def torch_npu() -> Iterator[ModuleType]:
    with _importable() as module:
        yield module


@pytest.fixture(scope="session")
def importable_torch_npu() -> Callable[[], contextlib.AbstractContextManager[ModuleType]]:
    """`with importable_torch_npu() as torch_npu:` for a fixture wider than one test (a module's
    engine run), which the `torch_npu` fixture cannot serve."""
    return _importable


@pytest.fixture
def reference_npu(torch_npu: ModuleType) -> ModuleType:
    if REAL:
        pytest.skip("checks the reference torch_npu itself (DSV4_TORCH_NPU=real runs the real one)")
    return torch_npu
