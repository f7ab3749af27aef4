"""Helpers of the e2e tier (conftest.py says what selects it)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loadclient import STOP, finished, outcomes

from suite import skips, tools

ROOT = pathlib.Path(__file__).parents[2]
REQUIRED = ("KUBECONFIG", "DSV4_E2E_ENGINE_IMAGE", "DSV4_E2E_OPERATOR_IMAGE")
# The CPU example's new model revision: the engine-cpu image bakes tiny-v2 beside tiny (Dockerfile).
ROLLOUT = json.dumps({"spec": {"model": {"image": {"path": "/opt/dsv4/models/tiny-v2"}}}})


def settings() -> dict[str, str]:
    missing = [k for k in REQUIRED if not os.environ.get(k)]
    if missing:
        skips.hardware(
            "cluster",
            "set "
            + ", ".join(missing)
            + " (KUBECONFIG of a kind cluster with the engine-cpu and operator images loaded, or of a"
            " cluster with Ascend nodes and the engine-ascend image, then also DSV4_E2E_EXAMPLE and"
            " DSV4_E2E_ROLLOUT_PATCH; see README 'The e2e tier against your cluster')",
        )
    helm, kubectl = tools.helm(), tools.kubectl()
    return {
        "helm": helm,
        "kubectl": kubectl,
        "engine": os.environ["DSV4_E2E_ENGINE_IMAGE"],
        "operator": os.environ["DSV4_E2E_OPERATOR_IMAGE"],
        "example": os.environ.get("DSV4_E2E_EXAMPLE", str(ROOT / "examples" / "cpu-tiny.yaml")),
        "namespace": os.environ.get("DSV4_E2E_NAMESPACE", "dsv4-e2e"),
        "ready": os.environ.get("DSV4_E2E_READY_SECONDS", "1800"),
        "rollout": os.environ.get("DSV4_E2E_ROLLOUT_PATCH", ROLLOUT),
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


@contextlib.contextmanager
def port_forward(kube: Kube, target: str, port: int) -> Iterator[str]:
    """`kubectl port-forward TARGET :PORT` (a Service or a Pod, "svc/NAME", "pod/NAME"): yields
    its base URL on 127.0.0.1. A Service's forward sticks to the one pod kubectl picked."""
    proc = subprocess.Popen(
        [kube.cfg["kubectl"], "port-forward", "-n", kube.ns, target, f":{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> 8000"
        match = re.search(r"127\.0\.0\.1:(\d+)", line)
        assert match, line
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        proc.kill()
        proc.wait()


class Client:
    """Where requests come from: this machine (the endpoint is port-forwarded here)."""

    def pool(self, workers: int) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(workers)


class InClusterLoad:
    """`loadclient.py` in a pod of the engine image, sending streamed chats to `url` (the endpoint
    Service by its cluster DNS name) from inside the cluster, where kube-proxy routes each new
    connection to the Service's ready addresses as they are now. `count`, `results` and `failures`
    as `serving.Load`'s, read from the pod's log; leaving the block stops it and waits until every
    request in flight has ended."""

    NAME = "dsv4-e2e-load"

    def __init__(self, kube: Kube, url: str, body: dict[str, Any], workers: int = 2) -> None:
        self.kube, self.url, self.body, self.workers = kube, url, body, workers
        self.results: list[tuple[str, str]] = []

    def _manifest(self) -> dict[str, Any]:
        source = (pathlib.Path(__file__).parent / "loadclient.py").read_text()
        restricted = {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": 65532,  # the image's USER
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        container = {
            "name": "load",
            "image": self.kube.cfg["engine"],
            "imagePullPolicy": "IfNotPresent",
            "command": ["python3", "-c", source, self.url, str(self.workers), json.dumps(self.body)],
            "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
            "securityContext": restricted,  # admitted by a namespace that enforces "restricted"
        }
        meta = {"name": self.NAME, "namespace": self.kube.ns, "labels": {"app": self.NAME}}
        spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 5, "containers": [container]}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}

    def _phase(self) -> str:
        return self.kube.get("pod", self.NAME, "-n", self.kube.ns).get("status", {}).get("phase", "")

    def _log(self) -> str:
        return self.kube.kubectl("logs", self.NAME, "-n", self.kube.ns).stdout

    def _delete(self) -> None:
        self.kube.kubectl("delete", "pod", self.NAME, "-n", self.kube.ns, "--ignore-not-found", "--wait")

    def __enter__(self) -> InClusterLoad:
        self._delete()  # one a crashed run left
        self.kube.kubectl("apply", "-f", "-", input=json.dumps(self._manifest()))
        wait_until(lambda: self._phase() in ("Running", "Succeeded", "Failed"), 600, "the load pod to start")
        return self

    def count(self) -> int:
        self.results = outcomes(self._log())
        return len(self.results)

    def failures(self) -> list[tuple[str, str]]:
        return [r for r in self.results if r[0] != "ok"]

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if exc_type is None:  # else the test's own error is the one to see
                self.kube.kubectl("exec", self.NAME, "-n", self.kube.ns, "--", "touch", STOP, check=False)
                ended = lambda: (p := self._phase()) in ("Succeeded", "Failed") and p  # noqa: E731
                phase = wait_until(ended, 300, "the load to end its requests in flight and exit")
                log = self._log()
                assert phase == "Succeeded" and finished(log), f"the load pod {phase}:\n{log[-3000:]}"
                self.results = outcomes(log)
        finally:
            self._delete()
