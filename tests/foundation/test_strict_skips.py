"""The test command's strictness (tests/suite/skips.py, tests/conftest.py), run on a throwaway suite
with the project's own conftest: with `DSV4_REQUIRE_REAL_KUBE` set, a missing tool fails its test
naming the tool, and a skip that is not a hardware one fails the run; without it (a developer's
partial set-up) both only skip. Either way the run ends listing every skip with its reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

SUITE = """
import pytest
from suite import skips

def test_needs_a_tool():
    skips.missing("no kubectl: scripts/get-kube-clients.sh failed (or set KUBECTL)")

def test_skips_for_no_reason_on_the_list():
    pytest.skip("helm not found")

def test_needs_an_npu():
    skips.hardware("npu")
"""


def _run(tmp_path: Path, strict: bool, *args: str) -> subprocess.CompletedProcess[str]:
    root = tmp_path / ("strict" if strict else "lenient") / "tests"
    (root / "tier").mkdir(parents=True)
    (root / "conftest.py").symlink_to(TESTS / "conftest.py")
    (root / "suite").symlink_to(TESTS / "suite")
    (root / "tier" / "test_tools.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if k != "DSV4_REQUIRE_REAL_KUBE"}
    env |= {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"} | ({"DSV4_REQUIRE_REAL_KUBE": "1"} if strict else {})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", *args, "tests"]
    return subprocess.run(cmd, cwd=root.parent, env=env, capture_output=True, text=True, timeout=300)


def test_a_strict_run_fails_on_a_missing_tool_and_on_a_skip_that_is_not_hardware(tmp_path: Path) -> None:
    got = _run(tmp_path, strict=True)
    out = got.stdout
    assert got.returncode == 1, out[-3000:]
    assert "FAILED tests/tier/test_tools.py::test_needs_a_tool" in out, out[-3000:]
    assert "no kubectl" in out and "DSV4_REQUIRE_REAL_KUBE is set" in out, out[-3000:]
    assert "NOT ALLOWED: helm not found" in out, out[-3000:]
    assert "allowed: [hardware:npu] no Ascend NPU here" in out, out[-3000:]
    assert "1 skips are not hardware ones" in out, out[-3000:]
    # The skip alone, every test passing or skipping, still fails the run.
    alone = _run(tmp_path / "alone", True, "-k", "not test_needs_a_tool")
    assert alone.returncode == 1 and "2 skipped" in alone.stdout, alone.stdout[-3000:]


def test_a_lenient_run_skips_both_and_says_which_are_not_hardware(tmp_path: Path) -> None:
    got = _run(tmp_path, strict=False)
    out = got.stdout
    assert got.returncode == 0, out[-3000:]
    assert "3 skipped" in out, out[-3000:]
    assert "not hardware: no kubectl" in out and "not hardware: helm not found" in out, out[-3000:]
