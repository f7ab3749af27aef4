"""The fused CPU kernels' build cache: built ahead by `python -m dsv4_engine.kernels`, one folder per
torch install, and it survives a build killed midway: torch's extension builder waits
for as long as its lock file exists, so a leftover lock (a pod stopped during start-up) must not make
every later start wait forever (dsv4_engine.kernels.build._build)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4_engine import kernels


def test_a_leftover_build_lock_does_not_stall_the_next_start() -> None:
    """A start imports the library its key built as it is, never asking torch's builder, whose lock
    file (left behind by a build killed midway) it would wait on for as long as the file exists."""
    assert kernels.available()  # built and cached: what a restarted pod finds
    lock = kernels.cache_dir() / "lock"
    # Planted under the build's own lock, as a dead builder leaves it (never in the middle of another
    # test's server starting).
    with open(kernels.cache_dir() / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        lock.write_text("")
    code = "from dsv4_engine import kernels; assert kernels.available()"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    try:
        # Bounded: a start that consulted torch's builder would wait on the lock forever.
        got = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        lock.unlink(missing_ok=True)
    assert got.returncode == 0, got.stderr[-2000:]


def test_a_cache_seen_under_two_paths_is_not_rebuilt(tmp_path: Path) -> None:
    """The cluster tier's pods mount the host's kernel cache at another path, as a pod would mount a
    volume: a start through that path imports the library the host built, and nothing is built
    (ninja's log does not grow: through torch's builder the compile command, which names the path,
    differed, and each start rebuilt what the other had built)."""
    assert kernels.available()
    here = kernels.cache_dir()
    alias = tmp_path / "mount" / "dsv4" / "kernels"
    alias.parent.mkdir(parents=True)
    alias.symlink_to(here.parent, target_is_directory=True)
    log = here / ".ninja_log"
    before = log.read_bytes() if log.exists() else b""
    code = "from dsv4_engine import kernels; assert kernels.available()"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "XDG_CACHE_HOME": str(tmp_path / "mount")}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert (log.read_bytes() if log.exists() else b"") == before


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


def test_a_prebuilt_library_loads_with_no_compiler_and_writes_nothing(tmp_path: Path) -> None:
    """An image without a compiler (engine-cpu): the library `--prebuilt-dir` put in
    DSV4_KERNELS_PREBUILT is imported as it is. The process finds no compiler on PATH and its own
    cache folder stays empty: it built nothing and wrote nothing."""
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    prebuilt = tmp_path / "prebuilt"
    args = [sys.executable, "-m", "dsv4_engine.kernels", "--prebuilt-dir", str(prebuilt)]
    got = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert got.returncode == 0, got.stderr[-2000:]
    lib = Path(got.stdout.strip()) / "dsv4_cpu_kernels.so"
    assert lib.is_file() and lib.parent.parent == prebuilt
    cache = tmp_path / "cache"
    cache.mkdir()
    code = (
        "import torch; from dsv4_engine.kernels import build; assert build.available(); "
        "x, w = torch.randn(3, 64), torch.randn(64); "
        "want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w; "
        "assert torch.allclose(build.module().rms_norm(x, w, 1e-6), want, atol=1e-5)"
    )
    bare = {
        **env,
        "DSV4_KERNELS_PREBUILT": str(prebuilt),
        "XDG_CACHE_HOME": str(cache),
        "PATH": "/nonexistent",
    }
    got = subprocess.run([sys.executable, "-c", code], env=bare, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert not any(cache.iterdir())
    without = {**bare, "DSV4_KERNELS_PREBUILT": str(tmp_path / "elsewhere")}  # the control: no library there
    got = subprocess.run(
        [sys.executable, "-c", code], env=without, capture_output=True, text=True, timeout=300
    )
    assert got.returncode != 0 and "fused CPU kernels unavailable" in got.stderr
