"""The ranks of a parallel server: what each builds, and the processes that follow rank 0.

`LLMEngine(tp_size=N)` (so `dsv4 serve --tp-size N`) is rank 0. It spawns ranks 1..N-1
(`Workers`); every rank joins the process groups and prewarms them, loads its shard of the
weights, and builds pools of the sizes rank 0 planned (`build_rank`). Then, for every step, rank 0
broadcasts what the step's forward needs (`StepBroadcast.send`): its allocator's changes since the
last step, which each rank replays on its own allocator, so every rank's pages and request tables
stay identical to rank 0's, and the `StepPlan`, which each rank runs through the same
`ModelRunner.forward`. Scheduling, sampling and serving are rank 0's alone; the other ranks hold no
request state beyond their pages. A pipe per rank (`Workers.links`) carries what rank 0 asks of a
rank besides steps: on a PD server, its own transport's writes (disagg/lanes.py).

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
from dsv4_engine.device import select_device
from dsv4_engine.engine_config import EngineConfig
from dsv4_engine.memory import Dsv4MemoryLayout, Dsv4TokenToKVPool, PagedMemory, PoolSizes
from dsv4_engine.memory.prefix_store import PageWrites, write_pages
from dsv4_engine.model import Dsv4ForCausalLM
from dsv4_engine.model_runner import ModelRunner, StepPlan
from dsv4_engine.parallel.groups import SINGLE, Parallel, destroy_groups, init_groups, prewarm, rank_device
from dsv4_engine.speculative import DraftRow

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
    from dsv4_engine.quant import store_grouped_scales

    config = Dsv4Config.from_pretrained(model_path)
    model = Dsv4ForCausalLM(config, max_positions=max_positions, parallel=parallel, mtp=mtp).cast(dtype)
    # W8A8 weights stay int8 where the device's kernel set runs them (NPU), else are dequantised.
    keep_int8 = choose_kernels(device).native_w8a8
    load_checkpoint(model, model_path, dtype=None, keep_int8=keep_int8)
    if keep_int8:
        store_grouped_scales(model, dtype)
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
    """What rank 0 broadcasts: a step to run (with the allocator's changes to replay first), the
    allocator's changes alone (before a PD window write: the snapshot copies queued before it read
    the ring first; before an imported prefix's pages), an imported prefix's page contents and MTP
    window, the MTP rows to draft after a step (speculative decoding), a PD transfer's MTP window, or
    stop."""

    kind: Literal["step", "journal", "pages", "prefix_window", "draft", "window", "stop"]
    journal: list[tuple[str, tuple]] = field(default_factory=list)
    step: StepPlan | None = None
    drafts: list[DraftRow] = field(default_factory=list)
    window: tuple[int, int, torch.Tensor] | None = None  # a PD transfer's MTP rows: row, start, rows
    pages: PageWrites | None = None  # page contents an imported prefix brings (memory/prefix_store.py)
    prefix_window: tuple[int, int, dict[str, torch.Tensor]] | None = None  # and its MTP window


class StepBroadcast:
    """`ModelRunner.followers` on rank 0: each step, and the allocator's changes before it."""

    def __init__(self, parallel: Parallel) -> None:
        self.parallel = parallel
        # Step messages sent: a PD write of a step's pages runs on a rank once it ran as many
        # (disagg/lanes.py), so it never reads pages that rank's forward is still filling.
        self.sent = 0

    def send(self, journal: list[tuple[str, tuple]], step: StepPlan) -> None:
        self._send(Message("step", journal, step=step))
        self.sent += 1

    def replay(self, journal: list[tuple[str, tuple]]) -> None:
        if journal:
            self._send(Message("journal", journal))

    def pages(self, writes: PageWrites) -> None:
        self._send(Message("pages", pages=writes))

    def prefix_window(self, row: int, n: int, window: dict[str, torch.Tensor]) -> None:
        self._send(Message("prefix_window", prefix_window=(row, n, window)))

    def draft(self, rows: list[DraftRow]) -> None:
        self._send(Message("draft", drafts=rows))

    def window(self, req_idx: int, start: int, rows: torch.Tensor) -> None:
        self._send(Message("window", window=(req_idx, start, rows)))

    def stop(self) -> None:
        self._send(Message("stop"))

    def _send(self, message: Message) -> None:
        torch.distributed.broadcast_object_list([message], src=0, group=self.parallel.cpu_group)


@dataclass(frozen=True)
class WorkerArgs:
    cfg: EngineConfig
    rank: int
    init_method: str
    log_level: int  # rank 0's: the ranks log as it does, their lines marked with their rank
    link: multiprocessing.connection.Connection  # the rank's end of its pipe to rank 0
    service: RankService | None  # what the rank runs on its link beside the steps

    def __reduce__(self) -> tuple[Any, ...]:
        # The device travels by name: unpickling torch.device("npu") in the new process needs
        # torch_npu imported first, which happens there only when the device asks for it.
        cfg = dataclasses.replace(self.cfg, device=torch.device("cpu"))
        fields = (self.rank, self.init_method, self.log_level, self.link, self.service)
        return _worker_args, (str(self.cfg.device), cfg, *fields)


def _worker_args(device: str, cfg: EngineConfig, *fields: Any) -> WorkerArgs:
    return WorkerArgs(dataclasses.replace(cfg, device=select_device(device)), *fields)


# What a rank runs on its thread beside the steps, given its link to rank 0, its pools, the steps'
# progress, its rank and device (a PD server's: disagg/lanes.serve, its own transport). The server
# passes it in, so this layer never imports the PD one; a module-level function pickles by name.
RankService = Callable[[multiprocessing.connection.Connection, Dsv4TokenToKVPool, "Progress", int, str], None]


class Progress:
    """Step messages a rank other than 0 has run (`follow` counts, a rank service waits on it: a PD
    write of a step's pages must not read them before this rank's forward filled them)."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()

    def advance(self) -> None:
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait(self, count: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.count >= count)


class Workers:
    """Ranks 1..N-1 as child processes of rank 0, watched."""

    def __init__(self, cfg: EngineConfig, service: RankService | None = None) -> None:
        self.cfg = cfg
        self._dir = tempfile.TemporaryDirectory(prefix="dsv4-ranks-")
        self.init_method = f"file://{self._dir.name}/rendezvous"
        self.failure: str | None = None
        # Called (on the watcher thread) with the failure line; the server stops on it.
        self.on_failure: Callable[[str], None] | None = None
        self._closing = threading.Event()
        ctx = multiprocessing.get_context("spawn")  # a fork would copy rank 0's threads and torch state
        pipes = [ctx.Pipe() for _ in range(1, cfg.tp_size)]
        self.links = [ours for ours, _ in pipes]  # rank 0's ends, ranks 1..N-1 in order
        level = logging.getLogger().getEffectiveLevel()
        self.processes = [
            ctx.Process(
                target=worker_main,
                args=(WorkerArgs(cfg, rank, self.init_method, level, theirs, service),),
                name=f"dsv4-rank{rank}",
                daemon=True,
            )
            for rank, (_, theirs) in enumerate(pipes, start=1)
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
    model = load_model(
        cfg.model, cfg.dtype, cfg.device, cfg.max_model_len, parallel, mtp=cfg.speculative_num_steps > 0
    )
    rank = build_rank(cfg, model, share_sizes(parallel, None))
    rank.runner.warmup()
    progress = Progress()
    if args.service is not None:
        threading.Thread(
            target=args.service, args=(args.link, rank.memory.kv, progress, args.rank, str(cfg.device)),
            name="dsv4-rank-service", daemon=True,
        ).start()  # fmt: skip
    follow(rank, parallel, progress)
    destroy_groups()
    # Told to stop, with nothing left to write: leave without the interpreter's teardown, where a
    # C++ thread of torch's still joinable at static destruction aborts the process ("terminate
    # called without an active exception", seen once in CI as exit code -6).
    logging.shutdown()
    os._exit(0)


def follow(rank: Rank, parallel: Parallel, progress: Progress) -> None:
    """Run rank 0's steps until it says stop."""
    allocator, runner = rank.memory.allocator, rank.runner
    streams = None  # the last step's last-layer streams, which its draft message reads
    with torch.inference_mode():
        while True:
            box: list[Any] = [None]
            torch.distributed.broadcast_object_list(box, src=0, group=parallel.cpu_group)
            message: Message = box[0]
            if message.kind == "stop":
                return
            if message.kind == "draft":
                runner.draft(message.drafts, streams)
                continue
            if message.kind == "window" and message.window is not None:
                runner.write_draft_window(*message.window)
                continue
            if message.kind == "pages" and message.pages is not None:
                write_pages(rank.memory.kv, message.pages)
                continue
            if message.kind == "prefix_window" and message.prefix_window is not None:
                assert runner.drafter is not None
                runner.drafter.cache.import_window(*message.prefix_window)
                continue
            allocator.replay(message.journal, runner.apply_state_copies)
            if message.step is not None:
                streams = runner.forward(message.step)
                progress.advance()
