"""A recording TransferEngine: initialize's arguments (and every other call's name) are appended as
JSON lines to $FAKE_MOONCAKE_LOG; registering works, writing is refused (nothing is moved)."""

from __future__ import annotations

import json
import os
from typing import Any


def _record(call: str, *args: Any) -> None:
    with open(os.environ["FAKE_MOONCAKE_LOG"], "a") as f:
        f.write(json.dumps({"call": call, "args": list(args)}) + "\n")


class TransferEngine:
    def initialize(self, hostname: str, metadata: str, protocol: str, device: str) -> int:
        _record("initialize", hostname, metadata, protocol, device)
        return 0

    def get_rpc_port(self) -> int:
        return 17777

    def batch_register_memory(self, ptrs: list[int], lens: list[int]) -> int:
        _record("batch_register_memory", len(ptrs))
        return 0

    def batch_unregister_memory(self, ptrs: list[int]) -> int:
        return 0

    def transfer_submit_write(self, peer: str, src: int, dst: int, n: int) -> int:
        return 0  # refused: this engine moves nothing

    def transfer_check_status(self, batch: int) -> int:
        return -1
