"""The reference's "hccl" process-group backend: collectives on "npu" tensors, computed by gloo.

torch_npu registers "hccl" with `torch.distributed.Backend.register_backend(..., devices=["npu"])`,
so `init_process_group("hccl")` gives a group whose collectives on "npu" tensors go to HCCL. Here the
same name gives a group whose collectives run gloo's on the tensors' host aliases (`_device`: an
"npu" tensor's memory is host memory), so the result lands in the "npu" tensor in place, as HCCL's
does. The engine needs `all_reduce` (the forward's sums, the prewarm) and `barrier`; every other
collective raises, so a new caller is noticed rather than silently served.

What it cannot be: a collective captured into an aclgraph (HCCL's are; the reference's graphs record
the ops that run through `_device.execute`, and gloo does not), so one issued while a capture is in
progress raises rather than running once at capture and never at replay.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from . import _device

NAME = "hccl"


class ReferenceHccl(dist.ProcessGroup):
    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:  # torch's name
        return NAME

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        if _device._state.capturing is not None:
            raise RuntimeError("the reference hccl cannot record a collective into an aclgraph capture")
        for t in tensors:
            if t.device.type != _device.NAME:
                raise RuntimeError(f"hccl all_reduce takes npu tensors, got one on {t.device}")
            if not t.is_contiguous():
                raise RuntimeError("hccl all_reduce takes contiguous tensors")
        return self._gloo.allreduce([_device.host_alias(t) for t in tensors], opts)

    def barrier(self, opts: Any) -> Any:
        return self._gloo.barrier(opts)


def install() -> None:
    """Register "hccl" for "npu" tensors, once per process (as torch_npu does on import)."""
    if getattr(dist.Backend, NAME.upper(), None) is not None:
        return
    dist.Backend.register_backend(NAME, ReferenceHccl, devices=[_device.NAME])
