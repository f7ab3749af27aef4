"""A reference `torch_npu` 2.14.0 for tests on a CPU: never on the product's import path.

`import torch_npu` (with tests/npu/reference on sys.path) makes "npu" a torch device whose tensors
are real tensors in host memory (`_device.py`), registers `torch.npu` (`npu/`), and defines the
torch_npu ops the engine's NPU kernel set calls, under `torch.ops.npu` with the wheel's schemas,
each written in plain torch from its documentation and rejecting what the hardware rejects
(`ops/`). Every op cites where its semantics and rules come from. `torch.Generator(device="npu")`
makes a Philox-like device generator (`_generator.py`).

Registration happens once per process, in the submodules; this file only re-exports, so the tests
can drop `torch_npu` from sys.modules (making it unimportable again for other tests) and import it
later without registering anything twice. The one process-wide name it rebinds, `torch.Generator`,
is rebound on every import and given back by `_generator.uninstall()` (the tests' fixture).
"""

from __future__ import annotations

from . import _device, _generator, _hccl, reference
from . import _streams as _streams  # tests reach its StreamHazard and record through the package
from . import npu as npu
from .ops import *  # noqa: F403  (the op functions, as torch_npu exposes them)
from .ops import __all__ as _ops

_device.install(npu)
_generator.install()
_hccl.install()

__version__ = "2.14.0"
__all__ = ["npu", "reference", *_ops]
