"""The fused CPU kernels' build cache survives a build killed midway: torch's extension builder waits
for as long as its lock file exists, so a leftover lock (a pod stopped during start-up) must not make
every later start wait forever (dsv4_engine.kernels.build._build)."""

from __future__ import annotations

import os
import subprocess
import sys

from dsv4_engine import kernels


def test_a_leftover_build_lock_does_not_stall_the_next_start() -> None:
    assert kernels.available()  # built and cached: what a restarted pod finds
    lock = kernels.cache_dir() / "lock"
    lock.write_text("")  # what a build killed midway leaves behind
    code = "from dsv4_engine import kernels; assert kernels.available()"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    # Bounded: without the fix this waits on the lock forever (torch polls it without a deadline).
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    assert not lock.exists()
