"""Tier 5, the cluster on this machine: the real tier (tests/suite/realkube.py: etcd, kube-apiserver,
kube-controller-manager) plus the test node agent (agent/), which binds pods and really runs them,
each in its own network and mount namespace; the operator installed by the chart runs as a pod.

Network: the agent's node namespace holds a bridge (10.244.0.1/24) and the API relay on 10.0.0.1:443
(the `kubernetes` Service's cluster IP); each pod has a veth on the bridge and a 10.244.0.x
address. The test process stays in the machine's namespace, which carries only loopback; it reaches
pod addresses from threads that joined the node namespace (`Node.pool`), there being no Service proxy.
There is no CNI either: the agent enforces NetworkPolicies itself (agent/netpol.py) and records each
applied generation (`Node.netpol()`); `Node.pod_pool` connects from inside a given pod's namespace.

Needs root (network namespaces, mounts) and helm (suite/tools.py), besides the real tier's
binaries; skipped without them unless the run is strict (tests/suite/skips.py).
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
import yaml

from suite import skips, tools

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))  # the agent package
from agent import netns  # noqa: E402
from serving import EARLIER, NAMESPACE, RELEASE, lease_holder, operator_pods  # noqa: E402

from suite.realkube import Cluster, run_cluster, wait_until  # noqa: E402


def helm_binary() -> str:
    if os.geteuid() != 0:
        skips.missing("the cluster tier needs root (network namespaces and mounts for its pods)")
    return tools.helm()


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
        path = netns.ns_path(self.namespace_of(pod))
        return ThreadPoolExecutor(workers, initializer=netns.enter, initargs=(path,))

    def namespace_of(self, pod: dict[str, Any]) -> str:
        """The network namespace the agent made for `pod` (named by its address's index in the pod
        network, never reused)."""
        n = int(ipaddress.ip_address(pod["status"]["podIP"])) - int(netns.POD_CIDR.network_address)
        return f"{self.prefix}-p{n}"

    def netpol(self) -> dict[str, Any]:
        """The agent's last applied NetworkPolicy generation: {"generation": N, "isolated": {pod IP:
        [Allow as a dict, ...]}, "disabled": why it enforces nothing, or None} (agent/netpol.py),
        written at its start and after each `nft -f` succeeded."""
        return json.loads((self.state / "netpol.json").read_text())


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
    """The real tier, its API server reaching the pod network through the agent's egress proxy
    (agent/relay.py: a webhook registered by Service reaches a Ready pod behind it)."""
    d = tmp_path_factory.mktemp("cluster-kube")
    with run_cluster(d, egress_socket=d / "egress.sock") as c:
        yield c


@dataclass
class EarlierRelease:
    """An earlier release of the chart and its operator, which `helm upgrade` moves from: the same code,
    but version 0.0.1 and a CRD without `spec.monitoring` (an optional field added since). `image` is
    what the node agent runs as `dsv4-operator:0.0.1` (agent/images.py); `chart` a copy of the chart
    at that appVersion, its crds/ the old CRD."""

    image: pathlib.Path
    chart: pathlib.Path
    crd: dict[str, Any]


@pytest.fixture(scope="session")
def earlier_release(tmp_path_factory: pytest.TempPathFactory) -> EarlierRelease:
    from dsv4_operator.crd import load_crd

    root = tmp_path_factory.mktemp("earlier-release")
    crd = load_crd(cel=False)
    del crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "monitoring"
    ]
    image = root / "image"
    dist = image / "site" / f"dsv4-{EARLIER}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: dsv4\nVersion: {EARLIER}\n")
    (image / "crd.yaml").write_text(yaml.safe_dump(crd))
    chart = root / "chart"
    shutil.copytree(ROOT / "charts" / "dsv4-operator", chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta.update(version="0.1.0", appVersion=EARLIER)
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    (chart / "crds" / "dsv4deployment.yaml").write_text(yaml.safe_dump(crd))
    return EarlierRelease(image, chart, crd)


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
    earlier_release: EarlierRelease,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Node]:
    state = tmp_path_factory.mktemp("agent")
    prefix = f"dsv4t{os.getpid()}"
    log = state / "agent.log"
    api = kube.server.removeprefix("https://")
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", f"--kubeconfig={kube.kubeconfig}", f"--api={api}",
         f"--model=tiny={tiny_model}", f"--model=tiny-v2={tiny_model_v2}", f"--state-dir={state}", f"--netns-prefix={prefix}",
         f"--operator-release={EARLIER}={earlier_release.image}", f"--egress-socket={kube.dir / 'egress.sock'}"],
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
def operator_release(kube: Cluster, node: Node, helm: str, earlier_release: EarlierRelease) -> dict[str, Any]:
    """The earlier release of the chart installed as a user installs it, with its default values: two
    operator replicas with leader election, the admission webhook (reached through its Service).
    --skip-crds, with the release's CRD applied in its place, CEL stripped: 1.20 cannot store CEL
    rules (`dsv4 render --crd --no-cel`). test_cluster_chart.py upgrades it to this checkout's chart.
    Returns an operator pod once both are Ready, one holds the Lease and the webhook is registered."""
    old = {**earlier_release.crd, "metadata": {**earlier_release.crd["metadata"]}}
    old["metadata"]["resourceVersion"] = kube.get("crd/dsv4deployments.dsv4.ai")["metadata"][
        "resourceVersion"
    ]
    kube.kubectl("replace", "-f", "-", input=json.dumps(old))
    proc = subprocess.run(
        [helm, "install", RELEASE, str(earlier_release.chart), "--namespace", NAMESPACE,
         f"--kubeconfig={kube.kubeconfig}", "--skip-crds"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    pods = wait_until(
        lambda: len(operator_pods(kube)) == 2 and operator_pods(kube), 180, "both operator pods Ready"
    )
    wait_until(lambda: lease_holder(kube), 120, "an operator to hold the Lease")
    wait_until(
        lambda: kube.get("validatingwebhookconfigurations")["items"], 120, "the webhook's registration"
    )
    return pods[0]


@pytest.fixture(scope="session")
def until() -> Callable[..., Any]:
    return wait_until
