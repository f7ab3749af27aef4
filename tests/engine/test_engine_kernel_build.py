"""The fused CPU kernels' build cache: built ahead by `python -m dsv4_engine.kernels`, one folder per
torch install, and it survives a build killed midway: torch's extension builder waits
for as long as its lock file exists, so a leftover lock (a pod stopped during start-up) must not make
every later start wait forever (dsv4_engine.kernels.build._build)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

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


def test_each_torch_install_builds_into_its_own_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The build file names torch's headers by path: two venvs sharing one folder would rebuild each
    other's library on every start, without a word. Each torch install gets its own folder."""
    here = kernels.cache_dir()
    assert here == kernels.cache_dir()  # stable for one install
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/site-packages/torch/__init__.py")
    assert kernels.cache_dir() != here


def test_python_m_dsv4_engine_kernels_builds_and_says_where() -> None:
    """What scripts/setup.sh runs before any server starts."""
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    got = subprocess.run(
        [sys.executable, "-m", "dsv4_engine.kernels"], env=env, capture_output=True, text=True, timeout=900
    )
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == str(kernels.cache_dir())
    assert (kernels.cache_dir() / "dsv4_cpu_kernels.so").is_file()
