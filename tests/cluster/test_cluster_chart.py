"""The chart's own account on the real API server: the operator the chart installed runs under it,
kept its CRD current with it (the one CRD it may patch), and it can do its job and nothing more;
`helm test` passes (its pod, the operator's image under that account, run by the node agent)."""

from __future__ import annotations

import re
import subprocess
from typing import Any

import pytest
from serving import NAMESPACE, NS, RELEASE

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(300)]


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
