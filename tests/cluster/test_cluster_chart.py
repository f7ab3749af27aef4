"""The chart as a user installs it, on the real API server with its pods run by the node agent.

In file order (the release is the session's): installed at an earlier release with its default
values, two operator replicas with leader election and the admission webhook; the webhook answers
through its Service; killing the Lease holder hands reconciling to the other replica; `helm upgrade`
to this checkout's chart, whose CRD gained a field, keeps and reconciles what exists, the new
operator bringing the CRD current under the chart's own ServiceAccount. Then the chart's account
can do its job and nothing more, and `helm test` passes."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
from typing import Any

import pytest
import yaml
from serving import (
    EARLIER,
    NAMESPACE,
    NS,
    OPERATOR_PODS,
    RELEASE,
    ROOT,
    is_ready,
    lease_holder,
    operator_pods,
)

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(300)]
CHART = ROOT / "charts" / "dsv4-operator"
# An example whose pods never run here (NPU resources, an image the agent does not have): the
# operator's own work, its children, is what these scenarios watch.
UNSCHEDULABLE = ROOT / "examples" / "minimal.yaml"


def _resource(namespace: str, name: str) -> str:
    body = yaml.safe_load(UNSCHEDULABLE.read_text())
    body["metadata"].update(namespace=namespace, name=name)
    return yaml.safe_dump(body)


def _statefulsets(kube: Any, namespace: str) -> set[str]:
    return {s["metadata"]["name"] for s in kube.get("statefulsets", "-n", namespace)["items"]}


def _reconciled(kube: Any, namespace: str, name: str) -> bool:
    got = kube.get("dsv4", name, "-n", namespace)
    return (got.get("status") or {}).get("observedGeneration") == got["metadata"]["generation"]


def _time(stamp: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def test_the_webhook_answers_through_its_service(kube: Any, operator_release: dict[str, Any]) -> None:
    """The chart registers the webhook by Service; the API server resolves it to a Ready operator
    pod and dials it through the pod network (the tier's egress proxy, as Konnectivity would): a rule
    the CEL-free CRD cannot check is refused by the webhook, naming the field."""
    (config,) = kube.get("validatingwebhookconfigurations")["items"]
    (hook,) = config["webhooks"]
    assert hook["clientConfig"]["service"]["namespace"] == NAMESPACE and "url" not in hook["clientConfig"]
    service = kube.get("service", hook["clientConfig"]["service"]["name"], "-n", NAMESPACE)
    endpoints = kube.get("endpoints", service["metadata"]["name"], "-n", NAMESPACE)
    ready = {p["status"]["podIP"] for p in operator_pods(kube)}
    assert {a["ip"] for sub in endpoints["subsets"] for a in sub["addresses"]} == ready
    kube.kubectl("create", "namespace", "webhook")
    try:
        bad = yaml.safe_load((ROOT / "examples" / "invalid" / "ep-not-dividing-tp.yaml").read_text())
        bad["metadata"]["namespace"] = "webhook"
        got = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(bad), check=False)
        assert got.returncode != 0 and "denied the request" in got.stderr, got.stderr
        assert "expertParallelSize" in got.stderr, got.stderr
        kube.kubectl("apply", "-f", "-", input=_resource("webhook", "fine"))  # and a valid one passes
    finally:
        kube.kubectl("delete", "namespace", "webhook", "--wait=false")


def test_killing_the_lease_holder_hands_reconciling_to_the_other_replica(
    kube: Any, operator_release: dict[str, Any], until: Any
) -> None:
    """The leader stalls (SIGSTOP: it stops renewing, as a hung or partitioned process would) and is
    then killed: the standby takes the Lease once it expires, never before, and reconciles; the
    killed replica, restarted in its pod, stands by. (A plain SIGKILL would race the restart, which
    is free to reclaim a Lease held under its own name.)"""
    kube.kubectl("create", "namespace", "ha")
    try:
        kube.kubectl("apply", "-f", "-", input=_resource("ha", "ha"))
        until(lambda: len(_statefulsets(kube, "ha")) == 2, 120, "the leader to render the children")
        leader = lease_holder(kube)
        (pod,) = [p for p in operator_pods(kube) if p["metadata"]["name"] == leader]
        (status,) = pod["status"]["containerStatuses"]
        pid = int(status["containerID"].removeprefix("harness://"))
        os.kill(pid, signal.SIGSTOP)
        lease = kube.get("lease", "-n", NAMESPACE)["items"][0]["spec"]  # its last renewal, or an earlier one
        standby = until(lambda: lease_holder(kube) not in (None, leader) and lease_holder(kube), 180,
                        "the standby to take the Lease")  # fmt: skip
        with contextlib.suppress(ProcessLookupError):  # its liveness probe may have had it killed already
            os.kill(pid, signal.SIGKILL)
        taken = kube.get("lease", "-n", NAMESPACE)["items"][0]["spec"]
        assert taken["leaseTransitions"] > lease["leaseTransitions"]
        # Not before the stalled holder's lease expired: never two leaders at once.
        expiry = _time(lease["renewTime"]) + datetime.timedelta(seconds=lease["leaseDurationSeconds"])
        assert _time(taken["acquireTime"]) >= expiry, (lease, taken)
        name = sorted(_statefulsets(kube, "ha"))[0]
        kube.kubectl("delete", "statefulset", name, "-n", "ha")
        until(lambda: name in _statefulsets(kube, "ha"), 120, f"the new leader {standby} to restore {name}")

        def restarted() -> bool:
            (p,) = [p for p in operator_pods(kube) if p["metadata"]["name"] == leader] or [None]
            return (
                p is not None and p["status"]["containerStatuses"][0]["restartCount"] > status["restartCount"]
            )

        until(restarted, 180, "the killed replica to be restarted and Ready")
        assert lease_holder(kube) == standby  # it stands by
    finally:
        kube.kubectl("delete", "namespace", "ha", "--wait=false")


def test_helm_upgrade_to_a_chart_whose_crd_changed_keeps_and_reconciles_resources(
    kube: Any, helm: str, operator_release: dict[str, Any], until: Any
) -> None:
    """`helm upgrade` never touches crds/: the upgraded operator brings the CRD current at start, under
    the chart's own ServiceAccount (its one CRD patch right), a resource stored under the old CRD is
    kept and reconciled, and the field the new CRD adds is accepted on it."""
    from dsv4_operator import crd_sync

    def crd() -> dict[str, Any]:
        return kube.get(f"crd/{crd_sync.CRD_NAME}")

    def has_monitoring() -> bool:
        schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        return "monitoring" in schema["properties"]["spec"]["properties"]

    assert crd()["metadata"]["annotations"][crd_sync.VERSION_ANNOTATION] == EARLIER and not has_monitoring()
    kube.kubectl("create", "namespace", "upgrade")
    try:
        kube.kubectl("apply", "-f", "-", input=_resource("upgrade", "kept"))
        until(lambda: len(_statefulsets(kube, "upgrade")) == 2, 120, "the earlier release's children")
        before = {p["metadata"]["uid"] for p in operator_pods(kube)}
        offset = kube.audit_offset()
        proc = subprocess.run(
            [helm, "upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, f"--kubeconfig={kube.kubeconfig}",
             "--wait", "--timeout", "5m"],
            capture_output=True, text=True, timeout=330,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr

        def upgraded() -> bool:
            pods = kube.get("pods", "-n", NAMESPACE, "-l", OPERATOR_PODS)["items"]
            new = [p for p in pods if p["metadata"]["uid"] not in before]
            return len(pods) == 2 and len(new) == 2 and all(is_ready(p) for p in new)

        until(upgraded, 240, "both replicas replaced by the upgraded operator")
        images = {p["spec"]["containers"][0]["image"] for p in operator_pods(kube)}
        assert images == {f"dsv4-operator:{yaml.safe_load((CHART / 'Chart.yaml').read_text())['appVersion']}"}
        until(has_monitoring, 120, "the upgraded operator to bring the CRD current")
        assert crd()["metadata"]["annotations"][crd_sync.VERSION_ANNOTATION] == crd_sync.operator_version()
        sa = operator_pods(kube)[0]["spec"]["serviceAccountName"]
        writes = kube.writes_since(offset, user=f"system:serviceaccount:{NAMESPACE}:{sa}")
        assert f"patch customresourcedefinitions/{crd_sync.CRD_NAME}" in writes, writes

        assert kube.get("dsv4", "kept", "-n", "upgrade")  # kept, and still reconciled
        patch = {"spec": {"monitoring": {"podMonitor": {"enabled": False}}, "decode": {"replicas": 2}}}

        def accepted() -> bool:  # kubectl validates against the OpenAPI the server republishes
            got = kube.kubectl("patch", "dsv4", "kept", "-n", "upgrade", "--type=merge", "-p", json.dumps(patch),
                               check=False)  # fmt: skip
            return got.returncode == 0

        until(accepted, 60, "the new field to be accepted on the kept resource")
        until(lambda: _reconciled(kube, "upgrade", "kept"), 120, "the upgraded operator to reconcile it")
        decode = next(
            s for s in kube.get("statefulsets", "-n", "upgrade")["items"] if "decode" in s["metadata"]["name"]
        )
        assert decode["spec"]["replicas"] == 2
    finally:
        kube.kubectl("delete", "namespace", "upgrade", "--wait=false")


def test_the_charts_account_can_do_its_job_and_nothing_more(
    kube: Any, operator_release: dict[str, Any]
) -> None:
    from dsv4_operator import crd_sync

    sa = operator_release["spec"]["serviceAccountName"]
    who = f"system:serviceaccount:{NAMESPACE}:{sa}"

    def can(*args: str) -> bool:
        return kube.kubectl("auth", "can-i", *args, f"--as={who}", check=False).stdout.strip() == "yes"

    # At start, under this account, the operator stamped the CRD the tier installed without a stamp.
    crd = kube.get(f"crd/{crd_sync.CRD_NAME}")
    assert crd["metadata"]["annotations"][crd_sync.VERSION_ANNOTATION] == crd_sync.operator_version()

    crds = "customresourcedefinitions.apiextensions.k8s.io"
    assert can("patch", "statefulsets.apps", "-n", NS)
    assert can("patch", "dsv4deployments.dsv4.ai", "--subresource=status", "-n", NS)
    assert can("patch", f"{crds}/{crd_sync.CRD_NAME}")
    assert not can("patch", f"{crds}/podmonitors.monitoring.coreos.com")  # another CRD
    assert not can("delete", f"{crds}/{crd_sync.CRD_NAME}")
    assert not can("create", crds)
    assert not can("get", "secrets", "-n", NS)  # no business with users' Secrets
    assert not can("get", "secrets", "-n", "kube-system")
    assert not can("create", "clusterrolebindings.rbac.authorization.k8s.io")
    assert not can("delete", "namespaces")


def test_helm_test_passes(kube: Any, helm: str, operator_release: dict[str, Any], until: Any) -> None:
    """Its pod checks the operator's /metrics through the metrics Service's name and reads the CRD
    with the chart's account; it exits non-zero on either failure, and helm reports the phase."""
    proc = subprocess.run(
        [helm, "test", RELEASE, "--namespace", NAMESPACE, f"--kubeconfig={kube.kubeconfig}", "--timeout", "4m"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"Phase:\s+Succeeded", proc.stdout), proc.stdout
    # The hook pod stays after a run (before-hook-creation): remove it, as a user's next run would.
    (name,) = re.findall(r"TEST SUITE:\s+(\S+)", proc.stdout)
    kube.kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=false")
    until(lambda: not kube.get("pods", "-n", NAMESPACE, "--field-selector", f"metadata.name={name}")["items"],
          120, "the helm test pod to be removed")  # fmt: skip
