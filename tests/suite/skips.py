"""The one list of skips a run may have, and the check that a run had no other.

A tier that cannot run because a tool is missing is a broken set-up, not a pass: the test command
installs every tool and sets `STRICT_ENV`, and then any skip whose reason is not one of `HARDWARE`
fails the run (tests/conftest.py counts them at the end and prints every skip with its reason). Only
what no package registry can supply may be missing: accelerators, a container runtime with a real
cluster, a kernel feature.
"""

from __future__ import annotations

import os
import re
from typing import NoReturn

import pytest

STRICT_ENV = "DSV4_REQUIRE_REAL_KUBE"  # the name the docs and the operator's tiers already use

HARDWARE: dict[str, str] = {
    "npu": "no Ascend NPU here",
    "gpu": "no CUDA GPU here",
    "cluster": "no real cluster here (kind needs a Docker daemon; Ascend nodes are elsewhere)",
    "avx2": "this CPU has no AVX2",
    "br_netfilter": "this kernel cannot filter bridged traffic (no br_netfilter, and it cannot be loaded)",
}

_TAG = re.compile(r"^\[hardware:(?P<kind>[a-z0-9_]+)\] ")


def strict() -> bool:
    return bool(os.environ.get(STRICT_ENV))


def hardware_reason(kind: str, detail: str = "") -> str:
    """The reason string of an allowed skip (also for `skipif(reason=...)`)."""
    if kind not in HARDWARE:
        raise KeyError(f"{kind!r} is not a hardware skip (tests/suite/skips.py HARDWARE)")
    return f"[hardware:{kind}] {HARDWARE[kind]}" + (f": {detail}" if detail else "")


def hardware(kind: str, detail: str = "") -> NoReturn:
    """Skip: the machine lacks `kind` (one of `HARDWARE`)."""
    pytest.skip(hardware_reason(kind, detail))


def missing(reason: str) -> NoReturn:
    """A tool or package the test command installs is absent: a failure where the run is strict, a
    skip saying so elsewhere (a developer's partial set-up)."""
    if strict():
        pytest.fail(f"{reason} ({STRICT_ENV} is set: the test command installs it)")
    pytest.skip(reason)


def allowed(reason: str) -> bool:
    """Whether a skip's reason is one of `HARDWARE` (pytest's 'Skipped: ' prefix stripped)."""
    m = _TAG.match(reason.removeprefix("Skipped: "))
    return bool(m) and m.group("kind") in HARDWARE
