"""The reference torch_npu (tests/npu/reference) is importable only inside the tests that ask for it.

Its device registration is process-wide and stays (torch allows one PrivateUse1 rename), but once a
test is done `import torch_npu` fails again, so `dsv4_engine.device.npu_available()` answers False
for every other test in the session, as it does on a machine without torch_npu.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REFERENCE = str(Path(__file__).parent / "reference")


@pytest.fixture
def torch_npu() -> Iterator[ModuleType]:
    sys.path.insert(0, REFERENCE)
    try:
        import torch_npu

        yield torch_npu
    finally:
        sys.path.remove(REFERENCE)
        sys.modules.pop("torch_npu", None)  # its submodules stay: nothing registers twice
