"""Helpers of the e2e tier (conftest.py says what selects it)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).parents[2]
REQUIRED = ("KUBECONFIG", "DSV4_E2E_ENGINE_IMAGE", "DSV4_E2E_OPERATOR_IMAGE")


def settings() -> dict[str, str]:
    missing = [k for k in REQUIRED if not os.environ.get(k)]
    helm = os.environ.get("DSV4_HELM") or shutil.which("helm")
    kubectl = shutil.which("kubectl")
    if missing or not helm or not kubectl:
        need = missing + ([] if helm else ["helm (or DSV4_HELM)"]) + ([] if kubectl else ["kubectl"])
        pytest.skip(
            "e2e needs a real cluster: set "
            + ", ".join(need)
            + " (KUBECONFIG of a kind cluster with the engine-cpu and operator images loaded, or of a"
            " cluster with Ascend nodes and the NPU image; see README 'On kind, from an empty cluster')"
        )
    return {
        "helm": helm,  # type: ignore[dict-item]
        "kubectl": kubectl,  # type: ignore[dict-item]
        "engine": os.environ["DSV4_E2E_ENGINE_IMAGE"],
        "operator": os.environ["DSV4_E2E_OPERATOR_IMAGE"],
        "example": os.environ.get("DSV4_E2E_EXAMPLE", str(ROOT / "examples" / "cpu-tiny.yaml")),
        "namespace": os.environ.get("DSV4_E2E_NAMESPACE", "dsv4-e2e"),
        "ready": os.environ.get("DSV4_E2E_READY_SECONDS", "1800"),
    }


def wait_until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
        except AssertionError:
            raise
        except Exception:
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(1)  # polling a real cluster's state, bounded by `timeout`


class Kube:
    def __init__(self, cfg: dict[str, str]) -> None:
        self.cfg, self.ns = cfg, cfg["namespace"]
        self.wait = staticmethod(wait_until)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [self.cfg["kubectl"], *args], input=input, capture_output=True, text=True, timeout=120
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr}")
        return proc

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", "-o", "json", *args).stdout)


class Client:
    """Where requests come from: this machine (the endpoint is port-forwarded here)."""

    def pool(self, workers: int) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(workers)
