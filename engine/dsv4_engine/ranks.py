"""The ranks of a parallel server: what each builds, and the processes that follow rank 0.

`LLMEngine(tp_size=N)` (so `dsv4 serve --tp-size N`) is rank 0. It spawns ranks 1..N-1
(`Workers`); every rank joins the process groups and prewarms them, loads its shard of the
weights, and builds pools of the sizes rank 0 planned (`build_rank`). Then, for every step, rank 0
broadcasts what the step's forward needs (`StepBroadcast.send`): its allocator's changes since the
last step, which each rank replays on its own allocator, so every rank's pages and request tables
stay identical to rank 0's, and the `StepPlan`, which each rank runs through the same
`ModelRunner.forward`. Scheduling, sampling and serving are rank 0's alone; the other ranks hold no
request state beyond their pages.

Failure is never a hang: a rank that exits is seen at once by rank 0's watcher thread, which logs
which rank died and how, stops the others, and fails the engine (`Workers.failure`; the server turns
it into a failing /health and exit status 1); a rank whose rank 0 dies exits at once (it watches
its parent's sentinel), and a collective whose peer stops answering fails after
`parallel.groups.COLLECTIVE_TIMEOUT_S`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from dsv4_engine.config import Dsv4Config
from dsv4_engine.engine_config import EngineConfig
from dsv4_engine.memory import Dsv4MemoryLayout, Dsv4TokenToKVPool, PagedMemory, PoolSizes, StateType
from dsv4_engine.model import Dsv4ForCausalLM
from dsv4_engine.model_runner import ModelRunner, StepPlan
from dsv4_engine.parallel.groups import SINGLE, Parallel, destroy_groups, init_groups, prewarm, rank_device

log = logging.getLogger(__name__)


def load_model(
    model_path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    parallel: Parallel = SINGLE,
    *,
    mtp: bool = False,
) -> Dsv4ForCausalLM:
    """The checkpoint's model, or on a parallel server this rank's shard of it; mtp: with its MTP
    layer (speculative decoding's draft model)."""
    from dsv4_engine.kernels import choose_kernels
    from dsv4_engine.loader import load_checkpoint

    config = Dsv4Config.from_pretrained(model_path)
    model = Dsv4ForCausalLM(config, max_positions=max_positions, parallel=parallel, mtp=mtp).cast(dtype)
    # W8A8 weights stay int8 where the device's kernel set runs them (NPU), else are dequantised.
    load_checkpoint(model, model_path, dtype=None, keep_int8=choose_kernels(device).native_w8a8)
    return model.to(device).eval()


@dataclass
class Rank:
    """What every rank of a server holds: its model (shard), pools and runner."""

    model: Dsv4ForCausalLM
    layout: Dsv4MemoryLayout
    memory: PagedMemory
    runner: ModelRunner


def build_rank(cfg: EngineConfig, model: Dsv4ForCausalLM, sizes: PoolSizes) -> Rank:
    layout = Dsv4MemoryLayout.from_config(model.config, page_size=cfg.page_size, kv_dtype=cfg.dtype)
    memory = PagedMemory.build(
        layout, sizes, cfg.max_num_seqs, cfg.max_model_len, cfg.device, prefix_cache=cfg.prefix_cache
    )
    runner = ModelRunner(model, memory.kv, memory.allocator, **cfg.runner_options())
    return Rank(model, layout, memory, runner)


def share_sizes(parallel: Parallel, sizes: PoolSizes | None) -> PoolSizes:
    """Rank 0's pool sizes, on every rank (every rank's pages mirror rank 0's)."""
    if parallel.tp_size == 1:
        assert sizes is not None
        return sizes
    box = [sizes]
    torch.distributed.broadcast_object_list(box, src=0, group=parallel.cpu_group)
    assert box[0] is not None
    return box[0]


def threads_per_rank(tp_size: int) -> int:
    """CPU ranks share the host's cores: more intra-op threads than cores only spin."""
    return max(1, (os.cpu_count() or 1) // tp_size)


# ---- rank 0 ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    """What rank 0 broadcasts: a step to run, pages to copy (PD decode), or stop; with the
    allocator's changes to replay first."""

    kind: Literal["step", "pages", "stop"]
    journal: list[tuple[str, tuple]] = field(default_factory=list)
    step: StepPlan | None = None
    pages: dict[StateType, list[int]] | None = None


class StepBroadcast:
    """`ModelRunner.followers` on rank 0: each step, and the allocator's changes before it."""

    def __init__(self, parallel: Parallel) -> None:
        self.parallel = parallel

    def send(self, journal: list[tuple[str, tuple]], step: StepPlan) -> None:
        self._send(Message("step", journal, step=step))

    def share_pages(
        self, journal: list[tuple[str, tuple]], kv: Dsv4TokenToKVPool, pages: dict[StateType, list[int]]
    ) -> None:
        """PD decode: a transfer wrote a request's state into rank 0's pools only; every rank copies
        those pages (one broadcast of them all). Sending the state over the network once and
        fanning it out over the server's own links moves tp_size times fewer bytes between servers
        than a transfer to every rank, and keeps the PD protocol the same at every parallel size."""
        self._send(Message("pages", journal, pages=pages))
        broadcast_pages(kv, pages, self.parallel)

    def stop(self) -> None:
        self._send(Message("stop"))

    def _send(self, message: Message) -> None:
        torch.distributed.broadcast_object_list([message], src=0, group=self.parallel.cpu_group)


def broadcast_pages(kv: Dsv4TokenToKVPool, pages: dict[StateType, list[int]], parallel: Parallel) -> None:
    """Rank 0's rows of `pages` (page ids per state type; the sentinel page 0 skipped) in every
    buffer, into the same rows of every rank's buffers, as one broadcast of their bytes."""
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for state_type, buffers in kv.buffers_by_type().items():
        ids = [p for p in pages.get(state_type, ()) if p]
        if ids:
            index = torch.tensor(ids, dtype=torch.long, device=kv.device)
            parts += [(buf, index) for buf in buffers]
    if not parts:
        return
    sizes = [len(index) * buf[0].nbytes for buf, index in parts]
    if parallel.is_driver:
        flat = torch.cat(
            [buf.index_select(0, index).contiguous().view(-1).view(torch.uint8) for buf, index in parts]
        )
    else:
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=kv.device)
    torch.distributed.broadcast(flat, src=0, group=parallel.device_group)
    if not parallel.is_driver:
        for (buf, index), chunk in zip(parts, flat.split(sizes), strict=True):
            buf.index_copy_(0, index, chunk.view(buf.dtype).view(len(index), *buf.shape[1:]))


@dataclass(frozen=True)
class WorkerArgs:
    cfg: EngineConfig
    rank: int
    init_method: str
    log_level: int  # rank 0's: the ranks log as it does, their lines marked with their rank


class Workers:
    """Ranks 1..N-1 as child processes of rank 0, watched."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self._dir = tempfile.TemporaryDirectory(prefix="dsv4-ranks-")
        self.init_method = f"file://{self._dir.name}/rendezvous"
        self.failure: str | None = None
        # Called (on the watcher thread) with the failure line; the server stops on it.
        self.on_failure: Callable[[str], None] | None = None
        self._closing = threading.Event()
        ctx = multiprocessing.get_context("spawn")  # a fork would copy rank 0's threads and torch state
        self.processes = [
            ctx.Process(
                target=worker_main,
                args=(WorkerArgs(cfg, rank, self.init_method, logging.getLogger().getEffectiveLevel()),),
                name=f"dsv4-rank{rank}",
                daemon=True,
            )
            for rank in range(1, cfg.tp_size)
        ]
        if cfg.device.type == "cpu":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks talk over loopback only
        for p in self.processes:
            p.start()
        self._watcher = threading.Thread(target=self._watch, name="dsv4-rank-watcher", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        alive = {p.sentinel: p for p in self.processes}
        while alive and not self._closing.is_set():
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=1.0):
                p = alive.pop(sentinel)  # type: ignore[call-overload]
                if self._closing.is_set():
                    return
                self._fail(p)
                return

    def _fail(self, dead: multiprocessing.process.BaseProcess) -> None:
        dead.join(5)  # reaps it: its exit code is known only then
        code = dead.exitcode
        how = (
            f"killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exit code {code}"
        )
        self.failure = (
            f"{dead.name} (pid {dead.pid}) died ({how}); a parallel server cannot run without every rank"
        )
        log.error("%s: stopping the server", self.failure)
        self._kill()
        if self.on_failure is not None:
            self.on_failure(self.failure)

    def _kill(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(5)

    def close(self, broadcast: StepBroadcast | None) -> None:
        """Stop the ranks: a stop message if they can still hear it, then the signals."""
        if self._closing.is_set():
            return
        self._closing.set()
        if broadcast is not None and self.failure is None and all(p.is_alive() for p in self.processes):
            with contextlib.suppress(Exception):
                broadcast.stop()
            for p in self.processes:
                p.join(10)
        self._kill()
        destroy_groups()
        self._dir.cleanup()


# ---- ranks 1..N-1 ----------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Exit when rank 0's process ends, however it ends. (Not PR_SET_PDEATHSIG: that fires when the
    spawning *thread* exits, and rank 0 spawns from the server's loader thread.)"""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="dsv4-parent-watch", daemon=True).start()


def worker_main(args: WorkerArgs) -> None:
    """A rank other than 0: join, load the shard, mirror rank 0's pools, follow its steps."""
    _die_with_parent()
    logging.basicConfig(
        level=args.log_level, format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s"
    )
    cfg = dataclasses.replace(args.cfg, device=rank_device(args.cfg.device, args.rank))
    if cfg.device.type == "cpu":
        torch.set_num_threads(threads_per_rank(cfg.tp_size))
    parallel = init_groups(args.rank, cfg.tp_size, cfg.ep_size, args.init_method, cfg.device)
    if cfg.prewarm:
        prewarm(parallel, cfg.device)
    model = load_model(cfg.model, cfg.dtype, cfg.device, cfg.max_model_len, parallel)
    rank = build_rank(cfg, model, share_sizes(parallel, None))
    rank.runner.warmup()
    follow(rank, parallel)
    destroy_groups()
    # Told to stop, with nothing left to write: leave without the interpreter's teardown, where a
    # C++ thread of torch's still joinable at static destruction aborts the process ("terminate
    # called without an active exception", seen once in CI as exit code -6).
    logging.shutdown()
    os._exit(0)


def follow(rank: Rank, parallel: Parallel) -> None:
    """Run rank 0's steps until it says stop."""
    allocator, runner = rank.memory.allocator, rank.runner
    with torch.inference_mode():
        while True:
            box: list[Any] = [None]
            torch.distributed.broadcast_object_list(box, src=0, group=parallel.cpu_group)
            message: Message = box[0]
            if message.kind == "stop":
                return
            allocator.replay(message.journal)
            if message.pages is not None:
                broadcast_pages(rank.memory.kv, message.pages, parallel)
            if message.step is not None:
                runner.forward(message.step)
