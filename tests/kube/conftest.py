"""Real tier: etcd + kube-apiserver + kube-controller-manager v1.20.2 on 127.0.0.1 (suite/realkube.py,
shared with tests/cluster), started once per session, with an audit log of every write; the operator
runs as its own process (`dsv4 operator`).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from suite import tools
from suite.realkube import (
    Cluster,
    free_port,
    run_cluster,
    stop_procs,
    wait_until,
)


@pytest.fixture(scope="session")
def helm() -> str:
    """The pinned helm, for the tests that install the chart (suite/tools.py)."""
    return tools.helm()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with run_cluster(tmp_path_factory.mktemp("kube")) as c:
        yield c


@dataclass
class Operator:
    proc: subprocess.Popen
    metrics_url: str
    liveness_url: str
    log: pathlib.Path

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            text = resp.read().decode()
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and (not want or want in line) and not line.startswith("#"):
                head, value = line.rsplit(" ", 1)
                if head.split("{")[0] == name:
                    total += float(value)
        return total

    def reconciles(self) -> float:
        return self.metric("dsv4_operator_reconcile_total")


def start_operator(cluster: Cluster, procs: list[subprocess.Popen], *extra: str) -> Operator:
    webhook_port, metrics_port, live_port = free_port(), free_port(), free_port()
    log = cluster.dir / f"operator-{len(procs)}.log"
    env = {**os.environ, "KUBECONFIG": str(cluster.operator_kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    webhook = "--no-webhook" not in extra
    args = [sys.executable, "-m", "dsv4_operator.cli", "operator", "--namespace=dsv4-system",
            *(["--webhook"] if webhook else []), "--webhook-host=127.0.0.1", "--webhook-addr=127.0.0.1", f"--webhook-port={webhook_port}",
            f"--metrics-port={metrics_port}", f"--liveness=http://127.0.0.1:{live_port}/healthz",
            "--resync-seconds=2", "--drain-seconds=5", *extra]  # fmt: skip
    proc = subprocess.Popen(
        args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    procs.append(proc)
    op = Operator(
        proc, f"http://127.0.0.1:{metrics_port}/metrics", f"http://127.0.0.1:{live_port}/healthz", log
    )

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"operator exited:\n{log.read_text()[-3000:]}")
        with urllib.request.urlopen(op.liveness_url, timeout=2) as resp:
            healthy = resp.status == 200
        if not webhook:
            return healthy
        hooks = cluster.get("validatingwebhookconfigurations")["items"]
        return healthy and any(h["metadata"]["name"] == "validate.dsv4.ai" for h in hooks)

    wait_until(up, 60, "operator liveness and its webhook configuration")
    return op


@pytest.fixture(name="start_operator")
def start_operator_fixture() -> Callable[..., Operator]:
    return start_operator


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Operator]:
    procs: list[subprocess.Popen] = []
    try:
        yield start_operator(cluster, procs)
    finally:
        stop_procs(procs)
