"""Tier 6: the tier-5 scenarios against a real cluster (kind with the CPU image, or Ascend nodes
with the NPU image). Selected by environment, skipped with what is missing otherwise:

  KUBECONFIG                the cluster (kubectl's current context is used)
  DSV4_E2E_ENGINE_IMAGE     the engine image the nodes can run, e.g. localhost/dsv4/engine-cpu:0.1.0
                            (kind: `kind load docker-image ...`) or your registry's Ascend image
  DSV4_E2E_OPERATOR_IMAGE   the operator image, e.g. dsv4-operator:0.1.0
optional:
  DSV4_E2E_EXAMPLE          the resource to apply (default examples/cpu-tiny.yaml; Ascend:
                            examples/ascend-1980.yaml or your own, with its model source)
  DSV4_E2E_NAMESPACE        where it goes (default dsv4-e2e, created)
  DSV4_E2E_READY_SECONDS    how long a generation may take to be Ready (default 1800: NPU model loads)
  DSV4_E2E_ROLLOUT_PATCH    the rollout scenario's JSON merge patch to a new model revision, one whose
                            weights differ (default: the engine-cpu image's second checkpoint,
                            {"spec": {"model": {"image": {"path": "/opt/dsv4/models/tiny-v2"}}}};
                            Ascend: e.g. {"spec": {"model": {"hostPath": {"path": "/data/models/NEW"}}}})
  DSV4_HELM, KUBECTL        helm and kubectl, else the pinned ones (scripts/get-kube-clients.sh)

The operator is installed by the chart (kept when it is already installed); the endpoint is
reached through `kubectl port-forward` to the endpoint Service, as a user would, except in the
rollout scenario: a port-forward sticks to the pod it picked, which the rollout deletes, so that
load runs in a pod of the engine image (loadclient.py) and reaches the Service by its DNS name.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from dsv4_operator.spec import parse

ROOT = pathlib.Path(__file__).parents[2]
# serving.py (tests/cluster): the scenarios' shared helpers; e2ekube.py beside this file.
sys.path[:0] = [str(ROOT / "tests" / "e2e"), str(ROOT / "tests" / "cluster")]
from e2ekube import Kube, port_forward, settings, wait_until  # noqa: E402


@pytest.fixture(scope="session")
def kube() -> Kube:
    return Kube(settings())


@pytest.fixture(scope="session")
def operator(kube: Kube) -> Iterator[None]:
    cfg = kube.cfg
    repo, _, tag = cfg["operator"].rpartition(":")
    if kube.kubectl("get", "crd", "dsv4deployments.dsv4.ai", check=False).returncode == 0:
        yield  # an operator is already installed: use it, leave it
        return
    subprocess.run(
        [cfg["helm"], "install", "dsv4-operator", str(ROOT / "charts" / "dsv4-operator"), "-n", "dsv4-system",
         "--create-namespace", "--set", f"image.repository={repo}", "--set", f"image.tag={tag}", "--wait",
         "--timeout", "10m"], check=True,
    )  # fmt: skip
    yield
    subprocess.run([cfg["helm"], "uninstall", "dsv4-operator", "-n", "dsv4-system", "--wait"], check=False)


@pytest.fixture(scope="module")
def deployment(kube: Kube, operator: None) -> dict[str, Any]:
    doc = yaml.safe_load(pathlib.Path(kube.cfg["example"]).read_text())
    doc["spec"]["image"] = kube.cfg["engine"]
    doc["metadata"]["namespace"] = kube.ns
    served = parse(doc).spec.model.served_model_name  # what requests name (the example's, or the default)
    kube.kubectl("create", "namespace", kube.ns, check=False)
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

    def ready() -> dict[str, Any] | None:
        status = kube.get("dsv4", doc["metadata"]["name"], "-n", kube.ns).get("status") or {}
        ok = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
        return {"name": doc["metadata"]["name"], "model": served, "doc": doc, **status} if ok else None

    return wait_until(ready, float(kube.cfg["ready"]), "the Dsv4Deployment to be Ready")


@pytest.fixture(scope="module")
def endpoint(kube: Kube, deployment: dict[str, Any]) -> Iterator[str]:
    """The endpoint Service, port-forwarded to 127.0.0.1."""
    with port_forward(kube, f"svc/{deployment['name']}", 8000) as base:
        yield f"{base}/v1"
