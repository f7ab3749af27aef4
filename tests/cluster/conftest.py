"""Tier 5, the cluster on this machine: the real tier (tests/kube/realkube.py: etcd, kube-apiserver,
kube-controller-manager) plus the test node agent (agent/), which binds pods and really runs them,
each in its own network and mount namespace; the operator installed by the chart runs as a pod.

Network: the agent's node namespace holds a bridge (10.244.0.1/24) and the API relay on 10.0.0.1:443
(the `kubernetes` Service's cluster IP); each pod has a veth on the bridge and a 10.244.0.x
address. The test process stays in the machine's namespace, which carries only loopback; it reaches
pod addresses from threads that joined the node namespace (`Node.pool`), there being no Service proxy.
There is no CNI either: the agent enforces NetworkPolicies itself (agent/netpol.py) and records each
applied generation (`Node.netpol()`); `Node.pod_pool` connects from inside a given pod's namespace.

Needs root (network namespaces, mounts) and helm (scripts/get-helm.sh), besides the real tier's
binaries; skipped without them unless DSV4_REQUIRE_REAL_KUBE is set.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(HERE.parent / "kube")]  # the agent package; realkube.py
from agent import netns  # noqa: E402
from realkube import Cluster, run_cluster, wait_until  # noqa: E402
from serving import NAMESPACE, RELEASE  # noqa: E402


def _need(reason: str) -> None:
    if os.environ.get("DSV4_REQUIRE_REAL_KUBE"):
        pytest.fail(reason)
    pytest.skip(reason)


def helm_binary() -> str:
    if os.geteuid() != 0:
        _need("the cluster tier needs root (network namespaces and mounts for its pods)")
    found = os.environ.get("DSV4_HELM") or shutil.which("helm")
    if not found:
        got = subprocess.run(["bash", str(ROOT / "scripts" / "get-helm.sh")], capture_output=True, text=True)
        found = got.stdout.strip() if got.returncode == 0 else None
    if not found:
        _need("the cluster tier needs helm: run scripts/get-helm.sh (or set DSV4_HELM)")
    return found  # type: ignore[return-value]


@dataclass
class Node:
    proc: subprocess.Popen
    log: pathlib.Path
    prefix: str
    state: pathlib.Path

    @property
    def path(self) -> str:
        return netns.ns_path(f"{self.prefix}-node")

    def log_of(self, pod: dict[str, Any], container: str) -> str:
        """All that `container` of `pod` wrote, every restart appended."""
        return (self.state / "pods" / pod["metadata"]["uid"] / f"{container}.log").read_text()

    def pod_logs(self, pod: dict[str, Any]) -> str:
        """Every container log of `pod` (by uid), for failure messages."""
        d = self.state / "pods" / pod["metadata"]["uid"]
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(d.glob("*.log")))

    def pod_namespaces(self) -> list[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = [line.split(" ")[0] for line in out.splitlines()]
        return [n for n in names if n.startswith(f"{self.prefix}-p")]

    def pool(self, workers: int) -> ThreadPoolExecutor:
        """Threads inside the node namespace: where pod addresses are reachable from."""
        return ThreadPoolExecutor(workers, initializer=netns.enter, initargs=(self.path,))

    def pod_pool(self, pod: dict[str, Any], workers: int = 1) -> ThreadPoolExecutor:
        """Threads inside `pod`'s own network namespace: connections from there are that pod's, as
        the node's NetworkPolicy rules see them (the agent names a pod's namespace by its address's
        index in the pod network, never reused)."""
        n = int(ipaddress.ip_address(pod["status"]["podIP"])) - int(netns.POD_CIDR.network_address)
        path = netns.ns_path(f"{self.prefix}-p{n}")
        return ThreadPoolExecutor(workers, initializer=netns.enter, initargs=(path,))

    def netpol(self) -> dict[str, Any]:
        """The agent's last applied NetworkPolicy generation: {"generation": N, "isolated": {pod IP:
        [Allow as a dict, ...]}} (agent/netpol.py), written after its `nft -f` succeeded."""
        path = self.state / "netpol.json"
        return json.loads(path.read_text()) if path.exists() else {"generation": 0, "isolated": {}}


def sweep(prefix: str) -> None:
    """Whatever a crashed agent left: its namespaces and anything still running in them."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    for line in names:
        name = line.split(" ")[0]
        if name.startswith(f"{prefix}-"):
            netns.delete(name)


@pytest.fixture(scope="session")
def helm() -> str:
    return helm_binary()


@pytest.fixture(scope="session")
def kube(helm: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with run_cluster(tmp_path_factory.mktemp("cluster-kube")) as c:
        yield c


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from dsv4_engine.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("cluster-ckpt") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model_v2(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A new revision of the same model: the same shapes and tokenizer, other weights."""
    from dsv4_engine.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("cluster-ckpt-v2") / "tiny-v2", seed=1)


@pytest.fixture(scope="session")
def node(
    kube: Cluster,
    tiny_model: pathlib.Path,
    tiny_model_v2: pathlib.Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Node]:
    state = tmp_path_factory.mktemp("agent")
    prefix = f"dsv4t{os.getpid()}"
    log = state / "agent.log"
    api = kube.server.removeprefix("https://")
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", f"--kubeconfig={kube.kubeconfig}", f"--api={api}",
         f"--model=tiny={tiny_model}", f"--model=tiny-v2={tiny_model_v2}", f"--state-dir={state}", f"--netns-prefix={prefix}"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    n = Node(proc, log, prefix, state)
    try:

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the agent exited:\n{log.read_text()[-3000:]}")
            return "agent: ready" in log.read_text()

        wait_until(up, 60, "the node agent")
        yield n
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        sweep(prefix)


@pytest.fixture(scope="session")
def operator_release(kube: Cluster, node: Node, helm: str) -> dict[str, Any]:
    """The chart installed (one replica, no webhook: the API server cannot reach pod addresses
    here; --skip-crds: the tier applied the CRD without its CEL rules, which 1.20 cannot store);
    returns the operator pod once Ready."""
    proc = subprocess.run(
        [helm, "install", RELEASE, str(ROOT / "charts" / "dsv4-operator"), "--namespace", NAMESPACE,
         f"--kubeconfig={kube.kubeconfig}", "--set", "replicaCount=1", "--set", "leaderElection.enabled=false",
         "--set", "webhook.enabled=false", "--set", "resyncSeconds=5", "--set", "drainSeconds=10", "--skip-crds"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return wait_until(lambda: ready_pod(kube, NAMESPACE, "app.kubernetes.io/name=dsv4-operator"), 180,
                      "the operator pod to be Ready")  # fmt: skip


def ready_pod(kube: Cluster, namespace: str, selector: str) -> dict[str, Any] | None:
    for pod in kube.get("pods", "-n", namespace, "-l", selector)["items"]:
        conditions = pod.get("status", {}).get("conditions") or []
        if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
            return pod
    return None


@pytest.fixture(scope="session")
def until() -> Callable[..., Any]:
    return wait_until
