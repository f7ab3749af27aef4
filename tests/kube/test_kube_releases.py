"""Two releases of the chart side by side on the real API server: each `helm install`ed into its own
namespace and watching only it, each operator run as the chart configured it (the Deployment's
arguments) under the chart's ServiceAccount token. This tier has no kubelet and its API server
cannot dial a pod, so the operators run as local processes and register their webhook by URL
(https://127.0.0.1:PORT) instead of by Service; everything else is what the chart installed.

Kubernetes 1.21+ labels every namespace `kubernetes.io/metadata.name=NAME`, which the webhooks'
namespaceSelector matches; this tier is 1.20, so the namespaces here carry the label from creation.
"""

from __future__ import annotations

import base64
import os
import pathlib
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml

from dsv4_operator import webhook
from suite.realkube import Cluster, _kubeconfig, free_port, stop_procs

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(240)]

ROOT = pathlib.Path(__file__).parents[2]
CHART = ROOT / "charts" / "dsv4-operator"
VALID = ROOT / "examples" / "minimal.yaml"
# Refused by the spec model only (a cross-field rule): the tier's CRD, without CEL, stores it.
INVALID = ROOT / "examples" / "invalid" / "chunk-not-multiple-of-page.yaml"
NAME = "dsv4"


@dataclass
class Release:
    name: str
    namespace: str  # the release's namespace, also the one namespace it watches
    account: str  # system:serviceaccount:NS:NAME, as the audit log and `can-i --as` name it
    webhook_config: str
    args: list[str]
    env: dict[str, str]
    log: pathlib.Path
    proc: subprocess.Popen | None = None


def run_helm(helm_bin: str, cluster: Cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm_bin, *args, f"--kubeconfig={cluster.kubeconfig}"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed: {proc.stdout}{proc.stderr}")
    return proc


def namespace(cluster: Cluster, ns: str) -> None:
    body = {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": ns, "labels": {webhook.NAMESPACE_NAME_LABEL: ns}}}  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))


def install(helm_bin: str, cluster: Cluster, name: str, ns: str) -> Release:
    """`helm install` watching `ns` only; the operator's command line is the rendered Deployment's,
    with the pod-only parts (Service registration, ports on 0.0.0.0) swapped for local ones."""
    namespace(cluster, ns)
    run_helm(helm_bin, cluster, "install", name, str(CHART), "--namespace", ns, "--skip-crds",
             "--set", f"watchNamespaces={{{ns}}}", "--set", "replicaCount=1")  # fmt: skip
    (dep,) = cluster.get("deployments", "-n", ns, "-l", f"app.kubernetes.io/instance={name}")["items"]
    pod = dep["spec"]["template"]["spec"]
    local = ("--webhook-service=", "--webhook-port=", "--metrics-port=", "--liveness=")
    args = [a.replace("$(POD_NAMESPACE)", ns).replace("$(POD_NAME)", f"{name}-local")
            for a in pod["containers"][0]["args"] if not a.startswith(local)]  # fmt: skip
    config = next(a.split("=", 1)[1] for a in args if a.startswith("--webhook-config="))
    sa = pod["serviceAccountName"]
    kubeconfig = cluster.dir / f"{ns}-{name}.kubeconfig"
    _kubeconfig(kubeconfig, cluster.server, cluster.wait(lambda: token(cluster, ns, sa), 60, f"{sa}'s token"))
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log = cluster.dir / f"operator-{ns}-{name}.log"
    return Release(name, ns, f"system:serviceaccount:{ns}:{sa}", config, args, env, log)


def token(cluster: Cluster, ns: str, sa: str) -> str | None:
    """The ServiceAccount's token (1.20's token controller writes it into a Secret)."""
    for ref in cluster.get("serviceaccount", sa, "-n", ns).get("secrets") or []:
        data = cluster.get("secret", ref["name"], "-n", ns).get("data") or {}
        if data.get("token"):
            return base64.b64decode(data["token"]).decode()
    return None


def start(cluster: Cluster, rel: Release, procs: list[subprocess.Popen]) -> None:
    live = free_port()
    args = [sys.executable, "-m", "dsv4_operator.cli", "operator", *rel.args, "--webhook-host=127.0.0.1",
            "--webhook-addr=127.0.0.1", f"--webhook-port={free_port()}", f"--metrics-port={free_port()}",
            f"--liveness=http://127.0.0.1:{live}/healthz"]  # fmt: skip
    rel.proc = subprocess.Popen(args, stdout=rel.log.open("a"), stderr=subprocess.STDOUT, env=rel.env,
                                start_new_session=True)  # fmt: skip
    procs.append(rel.proc)

    def up() -> bool:
        if rel.proc.poll() is not None:
            raise AssertionError(f"operator {rel.name} exited:\n{rel.log.read_text()[-3000:]}")
        with urllib.request.urlopen(f"http://127.0.0.1:{live}/healthz", timeout=2) as resp:
            healthy = resp.status == 200
        return healthy and bool(registered(cluster, rel))

    cluster.wait(up, 60, f"operator {rel.name}: liveness and its webhooks")


def stop(rel: Release) -> None:
    assert rel.proc is not None
    stop_procs([rel.proc])
    rel.proc = None


def registered(cluster: Cluster, rel: Release) -> list[dict]:
    got = cluster.kubectl(
        "get", "validatingwebhookconfiguration", rel.webhook_config, "-o", "json", check=False
    )
    if got.returncode != 0:  # absent
        return []
    return yaml.safe_load(got.stdout).get("webhooks") or []


def create(cluster: Cluster, path: pathlib.Path, ns: str, name: str = NAME) -> subprocess.CompletedProcess:
    body = yaml.safe_load(path.read_text())
    body["metadata"].update(namespace=ns, name=name)
    return cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(body), check=False)


def statefulsets(cluster: Cluster, ns: str, name: str = NAME) -> list[dict]:
    return cluster.get("statefulsets", "-n", ns, "-l", f"dsv4.ai/deployment={name}")["items"]


@pytest.fixture(scope="module")
def releases(cluster: Cluster, helm: str) -> Iterator[tuple[Release, Release]]:
    # Left by other modules' operators (a persistent registration for every namespace whose server
    # is gone): it would refuse every create here.
    cluster.kubectl("delete", "validatingwebhookconfiguration", "validate.dsv4.ai", "--ignore-not-found")
    procs: list[subprocess.Popen] = []
    try:
        a, b = install(helm, cluster, "alpha", "two-a"), install(helm, cluster, "beta", "two-b")
        for rel in (a, b):
            start(cluster, rel, procs)
        yield a, b
    finally:
        stop_procs(procs)
        for name, ns in (("alpha", "two-a"), ("beta", "two-b")):
            helm_proc = subprocess.run([helm, "uninstall", name, "-n", ns, f"--kubeconfig={cluster.kubeconfig}",
                                        "--ignore-not-found"], capture_output=True, text=True, timeout=120)  # fmt: skip
            assert helm_proc.returncode == 0, helm_proc.stderr


def test_each_release_registers_its_webhook_for_its_namespace_only(
    cluster: Cluster, releases: tuple[Release, Release]
) -> None:
    for rel in releases:
        (hook,) = registered(cluster, rel)
        assert hook["namespaceSelector"] == {
            "matchExpressions": [
                {"key": webhook.NAMESPACE_NAME_LABEL, "operator": "In", "values": [rel.namespace]}
            ]
        }
        assert hook["failurePolicy"] == "Fail" and hook["clientConfig"]["url"].endswith("/spec")
        # A resource only the spec model refuses is refused in each namespace by that release's webhook.
        got = create(cluster, INVALID, rel.namespace, "bad")
        assert got.returncode != 0 and f'admission webhook "spec.{rel.webhook_config}" denied' in got.stderr
        assert "chunkedPrefillSize" in got.stderr


def test_each_release_reconciles_only_its_own(cluster: Cluster, releases: tuple[Release, Release]) -> None:
    offset = cluster.audit_offset()
    for rel in releases:
        assert create(cluster, VALID, rel.namespace).returncode == 0
    for rel in releases:
        cluster.wait(lambda rel=rel: len(statefulsets(cluster, rel.namespace)) == 2, 60,
                     f"{rel.name} to reconcile its resource")  # fmt: skip
        status = cluster.get("dsv4deployments", NAME, "-n", rel.namespace).get("status") or {}
        assert status.get("observedGeneration") == 1
    a, b = releases
    for mine, other in ((a, b), (b, a)):
        assert cluster.writes_since(offset, user=mine.account, namespace=mine.namespace)
        assert cluster.writes_since(offset, user=mine.account, namespace=other.namespace) == []


def test_a_release_cannot_write_outside_its_namespaces(
    cluster: Cluster, releases: tuple[Release, Release]
) -> None:
    a, b = releases

    def can(rel: Release, *args: str) -> bool:
        got = cluster.kubectl("auth", "can-i", *args, f"--as={rel.account}", check=False)
        return got.stdout.strip() == "yes"

    for verb, what in (("create", "deployments.apps"), ("create", "services"), ("patch", "statefulsets.apps"),
                       ("patch", "dsv4deployments.dsv4.ai")):  # fmt: skip
        assert can(a, verb, what, "-n", a.namespace)
        for elsewhere in (b.namespace, "default", "kube-system"):
            assert not can(a, verb, what, "-n", elsewhere), (verb, what, elsewhere)
        assert not can(a, verb, what, "--all-namespaces")
    assert not can(a, "list", "dsv4deployments.dsv4.ai", "-n", b.namespace)  # nor read the other's
    assert not can(a, "get", "secrets", "-n", a.namespace)  # only its own certificate, by name
    assert not can(
        a, "patch", f"validatingwebhookconfigurations.admissionregistration.k8s.io/{b.webhook_config}"
    )


def test_an_overlapping_release_is_refused(
    cluster: Cluster, helm: str, releases: tuple[Release, Release]
) -> None:
    a, _ = releases
    namespace(cluster, "two-c")
    same = run_helm(helm, cluster, "install", "gamma", str(CHART), "-n", "two-c", "--skip-crds",
                "--set", f"watchNamespaces={{two-c,{a.namespace}}}", check=False)  # fmt: skip
    assert (
        same.returncode != 0
        and f"release {a.namespace}/{a.name} of dsv4-operator already serves {a.namespace}" in same.stderr
    )
    everywhere = run_helm(
        helm, cluster, "install", "delta", str(CHART), "-n", "two-c", "--skip-crds", check=False
    )
    assert everywhere.returncode != 0 and "already serves" in everywhere.stderr
    assert "a release with empty watchNamespaces serves every namespace" in everywhere.stderr
    # Nothing was installed, not even a failed release (helm keeps its records in Secrets).
    assert cluster.get("secrets", "-n", "two-c", "-l", "owner=helm")["items"] == []
    assert not [r for r in cluster.get("clusterroles")["items"] if "-two-c-" in r["metadata"]["name"]]


def test_one_release_down_or_uninstalled_leaves_the_other_working(
    cluster: Cluster, helm: str, releases: tuple[Release, Release]
) -> None:
    a, b = releases
    # A's operator gone (its pod evicted, say): its registration stays (failurePolicy Fail) and
    # refuses what it cannot judge in A's namespace, while B's namespace never asks it.
    stop(a)
    down = create(cluster, VALID, a.namespace, "while-down")
    assert down.returncode != 0 and f'failed calling webhook "spec.{a.webhook_config}"' in down.stderr
    assert create(cluster, VALID, b.namespace, "second").returncode == 0
    got = create(cluster, INVALID, b.namespace, "bad-second")
    assert got.returncode != 0 and f'admission webhook "spec.{b.webhook_config}" denied' in got.stderr

    # A uninstalled: its configuration goes with it; B's stays as it was and B keeps reconciling.
    before = registered(cluster, b)
    run_helm(helm, cluster, "uninstall", a.name, "-n", a.namespace)
    assert registered(cluster, a) == []
    assert registered(cluster, b) == before
    cluster.wait(
        lambda: len(statefulsets(cluster, b.namespace, "second")) == 2, 60, "B to reconcile a new resource"
    )
    (sts, *_) = statefulsets(cluster, b.namespace)
    cluster.kubectl("delete", "statefulset", sts["metadata"]["name"], "-n", b.namespace)
    restored = lambda: [s for s in statefulsets(cluster, b.namespace)  # noqa: E731
                        if s["metadata"]["name"] == sts["metadata"]["name"] and s["metadata"]["uid"] != sts["metadata"]["uid"]]  # fmt: skip
    cluster.wait(restored, 60, "B to restore a deleted child")
    assert create(cluster, VALID, a.namespace, "unserved").returncode == 0  # nobody judges A's namespace now
