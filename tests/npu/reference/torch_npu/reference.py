"""What the reference records for tests, and its settings (not part of torch_npu's API)."""

from __future__ import annotations

from collections import Counter
from typing import Any

memory_total = 1 << 30  # bytes the reference device reports (torch.npu.mem_get_info)
captures: list[Any] = []  # every NPUGraph captured in this process, in order
# Calls of each torch_npu op ("npu_grouped_matmul": n) issued by the caller (a graph replay re-runs
# its tape without counting), so a test can show which ops a forward ran; tests may clear it.
op_calls: Counter[str] = Counter()
# (op, stream id) of every device op issued while a test has set this to a list (`_streams`).
stream_log: list[tuple[str, int]] | None = None


def implicit_contexts() -> list[str]:
    """Threads that ran device work before calling torch.npu.set_device (see _device._State)."""
    from . import _device

    return list(_device._state.implicit_contexts)
