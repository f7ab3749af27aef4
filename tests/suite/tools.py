"""The pinned command-line tools of the test tiers, found one way: an explicit path in the
environment (the test command exports them), else the folder scripts/get-kube-clients.sh fills (run
here when empty), never whatever happens to be on PATH, so every machine runs the same versions."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from suite import skips

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _kube_clients() -> Path | None:
    got = subprocess.run(
        ["bash", str(ROOT / "scripts" / "get-kube-clients.sh")], capture_output=True, text=True, timeout=600
    )
    if got.returncode != 0:
        return None
    return Path(got.stdout.strip().splitlines()[-1])


def _client(name: str, env: str) -> str:
    if os.environ.get(env):
        return os.environ[env]
    folder = _kube_clients()
    if folder is None or not (folder / name).is_file():
        skips.missing(f"no {name}: scripts/get-kube-clients.sh failed (or set {env})")
    return str(folder / name)


def helm() -> str:
    """helm v4 (DSV4_HELM, else scripts/get-kube-clients.sh's)."""
    return _client("helm", "DSV4_HELM")


def kubectl() -> str:
    """kubectl v1.33 (KUBECTL, else scripts/get-kube-clients.sh's)."""
    return _client("kubectl", "KUBECTL")
