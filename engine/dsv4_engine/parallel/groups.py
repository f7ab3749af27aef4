"""The ranks of one server and the process groups they share.

A server of tp_size N runs N processes, one per rank; rank 0 serves HTTP, schedules and samples,
the others run the same forwards (ranks.py). Two groups span the N ranks:
- the device group (gloo on CPU, HCCL on NPU, NCCL on GPU) carries the forward's all-reduces;
- the CPU group (always gloo) carries rank 0's step messages, which are Python objects.
Every rank sums its partial outputs in the same all-reduce, so every rank ends a layer with the
same bytes (gloo's ring and the device libraries reduce each chunk once and share it) and the
replicated parts of the model (latent, indexer, routing) select the same rows everywhere.

With ep_size E (dividing N) the routed experts are split E ways and, within each expert group,
each expert's intermediate size N/E ways (`moe_tp`): rank r holds experts of group r // (N/E),
slice r % (N/E). Activations are replicated across ranks, so dispatch is choosing the pairs
routed to local experts, and the combine is the MoE's one all-reduce, shared with the shared
expert's partial sum.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

# A peer that stops answering fails a collective after this long instead of hanging the server
# (gloo's default is 30 minutes). A dead peer usually fails it at once: its sockets close.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Parallel:
    """This process's place in its server: rank of tp_size, and the expert split."""

    rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    # torch.distributed groups; None for one rank
    device_group: Any = field(default=None, compare=False, repr=False)
    cpu_group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} must divide tp_size {self.tp_size}")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank} outside tp_size {self.tp_size}")

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    def split(self, n: int, what: str) -> int:
        """n / tp_size, or a ValueError naming what does not split."""
        if n % self.tp_size:
            raise ValueError(f"{what} {n} is not divisible by tp_size {self.tp_size}")
        return n // self.tp_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `x` (identity on one rank): in place eagerly; inside a compiled step
        (the CPU decode step is one fullgraph `torch.compile`) the traceable functional form, which
        returns a new tensor."""
        if self.tp_size == 1:
            return x
        if torch.compiler.is_compiling():
            from torch.distributed import _functional_collectives as funcol

            return funcol.all_reduce(x, "sum", self.device_group)
        torch.distributed.all_reduce(x, group=self.device_group)
        return x


SINGLE = Parallel()


def local_o_groups(groups: int, tp_size: int) -> int:
    """Output-projection groups a rank holds: whole groups while tp_size divides them, else (tp_size
    a multiple of them) a share of one group's heads, whose partial projection the all-reduce sums."""
    if groups % tp_size == 0:
        return groups // tp_size
    if tp_size % groups == 0:
        return 1
    raise ValueError(f"o_groups {groups} and tp_size {tp_size}: one must divide the other")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device a rank computes on: rank r of a server takes accelerator r of its pod (all ranks
    of one server share the host's CPU)."""
    if device.type == "cpu":
        return device
    local = torch.device(device.type, rank)
    getattr(torch, device.type).set_device(local)
    return local


def device_backend(device: torch.device) -> str:
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device.type]


def init_groups(rank: int, tp_size: int, ep_size: int, init_method: str, device: torch.device) -> Parallel:
    """Join the server's process groups (every rank calls this with the same `init_method`)."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist = torch.distributed
    dist.init_process_group(
        device_backend(device), init_method=init_method, rank=rank, world_size=tp_size, timeout=timeout
    )
    device_group = dist.group.WORLD
    cpu_group = device_group if device.type == "cpu" else dist.new_group(backend="gloo", timeout=timeout)
    return Parallel(rank, tp_size, ep_size, device_group=device_group, cpu_group=cpu_group)


def prewarm(parallel: Parallel, device: torch.device) -> float:
    """One small collective on every group, before the server reports ready: the first collective
    of a group sets up its connections (seconds with HCCL), which would otherwise land on the first
    request. Returns the seconds it took."""
    if parallel.tp_size == 1:
        return 0.0
    t0 = time.perf_counter()
    x = torch.ones(1, device=device)
    torch.distributed.all_reduce(x, group=parallel.device_group)
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()
    torch.distributed.barrier(group=parallel.cpu_group)
    if int(x.item()) != parallel.tp_size:
        raise RuntimeError(f"process-group prewarm summed {x.item()} over {parallel.tp_size} ranks")
    seconds = time.perf_counter() - t0
    log.info("rank %d: process groups prewarmed in %.3f s", parallel.rank, seconds)
    return seconds


def destroy_groups() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
