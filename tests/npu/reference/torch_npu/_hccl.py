"""The reference's "hccl" process-group backend: collectives on "npu" tensors, computed by gloo.

torch_npu registers "hccl" with `torch.distributed.Backend.register_backend(..., devices=["npu"])`,
so `init_process_group("hccl")` gives a group whose collectives on "npu" tensors go to HCCL. Here the
same name gives a group whose collectives run gloo's on the tensors' host aliases (`_device`: an
"npu" tensor's memory is host memory), so the result lands in the "npu" tensor in place, as HCCL's
does. The engine needs `all_reduce` (the forward's sums, the prewarm) and `barrier`; every other
collective raises, so a new caller is noticed rather than silently served.

Each all-reduce is a device op of the reference (`_device.execute`): issued on the current stream, so
its order against work on other streams is checked as any op's, and recorded into an aclgraph being
captured, so every replay sums again, as HCCL's captured task does. Every rank must capture and replay
its graphs in the same order (the engine's ranks do: the same buckets, the same steps).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from . import _device

NAME = "hccl"


class ReferenceHccl(dist.ProcessGroup):
    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:  # torch's name
        return NAME

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        for t in tensors:
            if t.device.type != _device.NAME:
                raise RuntimeError(f"hccl all_reduce takes npu tensors, got one on {t.device}")
            if not t.is_contiguous():
                raise RuntimeError("hccl all_reduce takes contiguous tensors")

        def run(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
            self._gloo.allreduce([_device.host_alias(t) for t in ts], opts).wait()
            return ts

        # A device op on the current stream, in place: ordered against the other streams' work like
        # any op, and, inside a capture, recorded so that every replay sums again (as HCCL's task).
        _device.execute("hccl::allreduce", run, tuple(tensors), {}, written=list(tensors))
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(tensors)
        return _create_work_from_future(done)

    def barrier(self, opts: Any) -> Any:
        return self._gloo.barrier(opts)


def install() -> None:
    """Register "hccl" for "npu" tensors, once per process (as torch_npu does on import)."""
    if getattr(dist.Backend, NAME.upper(), None) is not None:
        return
    dist.Backend.register_backend(NAME, ReferenceHccl, devices=[_device.NAME])
