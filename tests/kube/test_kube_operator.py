"""The operator on a real kube-apiserver + kube-controller-manager (v1.20.2, no CEL, no kubelet):
tests set pod status themselves where Ready pods are needed."""

from __future__ import annotations

import json
import pathlib
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import pytest
import yaml

from dsv4_operator import manifests, spec
from dsv4_operator.fingerprint import deployment_fingerprint
from dsv4_operator.reconcile import DRAIN_ANNOTATION

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(240)]

ROOT = pathlib.Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))
KINDS = "statefulsets,deployments,services,configmaps,serviceaccounts,roles,rolebindings,poddisruptionbudgets,networkpolicies"


def load(path: pathlib.Path, namespace: str, name: str | None = None) -> dict:
    body = yaml.safe_load(path.read_text())
    body["metadata"]["namespace"] = namespace
    if name:
        body["metadata"]["name"] = name
    return body


def apply(cluster: Any, body: dict) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))


def children(cluster: Any, ns: str, name: str) -> dict[tuple[str, str], dict]:
    items = cluster.get(KINDS, "-n", ns, "-l", f"dsv4.ai/deployment={name}", "--show-managed-fields")["items"]
    return {(o["kind"], o["metadata"]["name"]): o for o in items}


def rendered(body: dict) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in manifests.render(spec.parse(body))}


def resource(cluster: Any, ns: str, name: str) -> dict:
    return cluster.get("dsv4deployments", name, "-n", ns)


def condition(cluster: Any, ns: str, name: str, type_: str) -> dict:
    conds = (resource(cluster, ns, name).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == type_), {})


def printed(cluster: Any, ns: str, name: str) -> dict[str, str]:
    """The READY and REASON columns of `kubectl get dsv4 NAME` (the CRD's printer columns)."""
    header, row = cluster.kubectl("get", "dsv4", name, "-n", ns).stdout.splitlines()
    cells = dict(zip(header.split(), row.split(), strict=True))
    return {k: cells[k] for k in ("READY", "REASON")}


def patch(cluster: Any, what: str, ns: str, body: dict, *extra: str) -> None:
    cluster.kubectl("patch", what, "-n", ns, "--type=merge", "-p", json.dumps(body), *extra)


def set_pod_status(cluster: Any, ns: str, pod: str, status: dict) -> None:
    patch(cluster, f"pod/{pod}", ns, {"status": status}, "--subresource=status")


READY = {
    "phase": "Running",
    "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True"},
        {"type": "ContainersReady", "status": "True"},
    ],
}


def make_ready(cluster: Any, ns: str, name: str, fp: str) -> None:
    """Play kubelet: mark the generation's pods Ready until its controllers report every replica ready."""

    def done() -> bool:
        pods = cluster.get("pods", "-n", ns, "-l", f"dsv4.ai/deployment={name},dsv4.ai/fingerprint={fp}")[
            "items"
        ]
        for pod in pods:
            if not any(
                c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])
            ):
                set_pod_status(cluster, ns, pod["metadata"]["name"], READY)
        workloads = [
            o for (k, _), o in children(cluster, ns, name).items() if k in ("StatefulSet", "Deployment")
        ]
        mine = [o for o in workloads if o["metadata"]["labels"].get("dsv4.ai/fingerprint") == fp]
        return bool(mine) and all(
            (o.get("status") or {}).get("readyReplicas", 0) == o["spec"]["replicas"] for o in mine
        )

    cluster.wait(done, 60, f"generation {fp} ready")


def test_crd_is_established(cluster: Any) -> None:
    crd = cluster.get("crd/dsv4deployments.dsv4.ai")
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"


def test_every_example_is_accepted_and_realised(cluster: Any, operator: Any) -> None:
    """Every child the plan renders exists. This tier has no Prometheus Operator, so an example that
    asks for a PodMonitor gets everything else, and a Degraded condition that names the PodMonitor."""
    assert EXAMPLES
    served = set(cluster.kubectl("api-versions").stdout.split())
    for path in EXAMPLES:
        ns = f"ex-{path.stem}"
        cluster.kubectl("create", "namespace", ns)
        body = load(path, ns)
        apply(cluster, body)
        want = rendered(body)
        unserved = {k for k in want if k[0] == "PodMonitor" and "monitoring.coreos.com/v1" not in served}
        want -= unserved
        name = body["metadata"]["name"]
        cluster.wait(lambda: want <= set(children(cluster, ns, name)), 60, f"children of {path.name}")  # noqa: B023
        if unserved:
            cluster.wait(
                lambda: "PodMonitor" in condition(cluster, ns, name, "Degraded").get("message", ""),  # noqa: B023
                60,
                f"{path.name}: a Degraded condition naming the PodMonitor this cluster cannot store",
            )


def _rejection(cluster: Any, path: pathlib.Path) -> tuple[pathlib.Path, str, int]:
    proc = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(load(path, "invalid")), check=False)
    return path, proc.stderr, proc.returncode


def test_every_invalid_example_is_rejected_naming_the_field(cluster: Any, operator: Any) -> None:
    assert INVALID
    cluster.kubectl("create", "namespace", "invalid")
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: _rejection(cluster, p), INVALID))
    problems = []
    for path, stderr, rc in results:
        field = next(
            line.split(":", 1)[1].strip()
            for line in path.read_text().splitlines()
            if line.startswith("# breaks:")
        )
        leaf = field.split(".")[-1].split("[")[0]
        if rc == 0 or leaf not in stderr:
            problems.append(f"{path.name} (expects {field}): rc={rc} {stderr.strip()[:300]}")
    assert not problems, "\n".join(problems)
    assert cluster.get("dsv4deployments", "-n", "invalid")["items"] == []


def test_lifecycle(cluster: Any, operator: Any) -> None:
    ns, name = "life", "demo"
    cluster.kubectl("create", "namespace", ns)
    body = load(ROOT / "examples" / "minimal.yaml", ns, name)
    apply(cluster, body)
    fp = deployment_fingerprint(spec.parse(body))

    # Children: every rendered object, owned by the resource, applied by the operator's field manager.
    cluster.wait(lambda: rendered(body) <= set(children(cluster, ns, name)), 60, "children")
    uid = resource(cluster, ns, name)["metadata"]["uid"]
    for obj in children(cluster, ns, name).values():
        assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid]
        assert "dsv4-operator" in {m["manager"] for m in obj["metadata"]["managedFields"]}

    # A child deleted by hand comes back.
    decode = f"{name}-decode-{fp}"
    old_uid = children(cluster, ns, name)[("StatefulSet", decode)]["metadata"]["uid"]
    cluster.kubectl("delete", "statefulset", decode, "-n", ns)
    cluster.wait(
        lambda: children(cluster, ns, name).get(("StatefulSet", decode), {}).get("metadata", {}).get("uid")
        not in (None, old_uid), 30, "deleted StatefulSet restored",
    )  # fmt: skip

    # `kubectl get dsv4` says why it is not Ready (the REASON column: the Ready condition's reason).
    cluster.wait(
        lambda: condition(cluster, ns, name, "Ready").get("reason") == "RolesNotReady", 30, "RolesNotReady"
    )
    assert printed(cluster, ns, name) == {"READY": "False", "REASON": "RolesNotReady"}

    # Status: Ready once the pods are; the endpoint and observedGeneration are reported.
    make_ready(cluster, ns, name, fp)
    cluster.wait(lambda: condition(cluster, ns, name, "Ready").get("status") == "True", 30, "Ready")
    assert printed(cluster, ns, name) == {"READY": "True", "REASON": "AllRolesReady"}
    status = resource(cluster, ns, name)["status"]
    assert status["observedGeneration"] == resource(cluster, ns, name)["metadata"]["generation"]
    assert status["endpoint"].startswith(f"http://{name}.{ns}.svc:")
    assert status["decode"]["readyReplicas"] == 1 and status["servingFingerprint"] == fp

    # A resync that finds nothing to change sends no write request (the API server's audit log), in
    # any namespace: an earlier example's PodMonitor, which this tier cannot store, is not retried.
    offset, before = cluster.audit_offset(), operator.reconciles()
    cluster.wait(lambda: operator.reconciles() >= before + 3, 30, "three reconciles")
    assert cluster.writes_since(offset) == []

    # Scaling prefill touches prefill only: decode and router are not written, their pods not replaced.
    decode_pods = {
        p["metadata"]["uid"] for p in cluster.get("pods", "-n", ns, "-l", "dsv4.ai/role=decode")["items"]
    }
    offset = cluster.audit_offset()
    patch(cluster, f"dsv4deployment/{name}", ns, {"spec": {"prefill": {"replicas": 2}}})
    prefill = f"{name}-prefill-{fp}"
    cluster.wait(
        lambda: children(cluster, ns, name)[("StatefulSet", prefill)]["spec"]["replicas"] == 2, 30, "scaled"
    )
    make_ready(cluster, ns, name, fp)
    writes = cluster.writes_since(offset)
    assert any(prefill in w for w in writes)
    assert not [w for w in writes if f"{name}-decode-" in w or f"{name}-router-" in w], writes
    assert {
        p["metadata"]["uid"] for p in cluster.get("pods", "-n", ns, "-l", "dsv4.ai/role=decode")["items"]
    } == decode_pods

    # A fingerprint change rolls a new generation beside the old; the endpoint waits for it.
    patch(
        cluster,
        f"dsv4deployment/{name}",
        ns,
        {"spec": {"image": "registry.example.com/dsv4/engine-ascend:0.2.0"}},
    )
    new = resource(cluster, ns, name)
    new_fp = deployment_fingerprint(spec.parse(new))
    assert new_fp != fp
    cluster.wait(
        lambda: ("StatefulSet", f"{name}-decode-{new_fp}") in children(cluster, ns, name),
        30,
        "new generation",
    )

    def selector() -> str:
        return children(cluster, ns, name)[("Service", name)]["spec"]["selector"]["dsv4.ai/fingerprint"]

    assert selector() == fp
    pod = cluster.wait(
        lambda: cluster.get("pods", "-n", ns, "-l", f"dsv4.ai/fingerprint={new_fp},dsv4.ai/role=decode")["items"],
        30, "a new decode pod",
    )[0]["metadata"]["name"]  # fmt: skip
    set_pod_status(cluster, ns, pod, {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                      "message": "0/3 nodes are available: 3 Insufficient huawei.com/Ascend910."}]})  # fmt: skip
    cluster.wait(
        lambda: condition(cluster, ns, name, "Progressing").get("reason") == "InsufficientCapacity",
        30,
        "shortage",
    )
    assert "Insufficient huawei.com/Ascend910" in condition(cluster, ns, name, "Progressing")["message"]
    assert condition(cluster, ns, name, "Ready")["status"] == "True" and selector() == fp  # old keeps serving
    make_ready(cluster, ns, name, new_fp)
    cluster.wait(lambda: selector() == new_fp, 30, "endpoint moved to the new generation")
    # The old generation drains (--drain-seconds 5) before it goes: the Service records until when,
    # and the operator's Deleted event comes no earlier.
    note = children(cluster, ns, name)[("Service", name)]["metadata"]["annotations"][DRAIN_ANNOTATION]
    drained, until = note.split()
    assert drained == fp
    cluster.wait(
        lambda: not [k for k in children(cluster, ns, name) if fp in k[1]], 60, "old generation deleted"
    )
    deleted = [e for e in cluster.get("events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
               if e["reason"] == "Deleted" and fp in e["message"]]  # fmt: skip
    assert deleted
    when = max(datetime.fromisoformat(e["lastTimestamp"].replace("Z", "+00:00")).timestamp() for e in deleted)
    assert when >= float(until) - 1  # event times have a second's resolution
    assert rendered(new) <= set(children(cluster, ns, name))
    events = cluster.get("events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
    assert "EndpointMoved" in {e["reason"] for e in events}

    # Deleting the resource leaves nothing behind (garbage collection by owner references).
    cluster.kubectl("delete", "dsv4deployment", name, "-n", ns, "--wait=true", "--timeout=60s")
    cluster.wait(lambda: not children(cluster, ns, name), 60, "children collected")
    cluster.wait(lambda: not cluster.get("pods", "-n", ns)["items"], 60, "pods collected")


def test_operator_metrics_count_reconciles(operator: Any) -> None:
    assert operator.reconciles() > 0
    assert operator.metric("dsv4_operator_reconcile_duration_seconds_count") > 0


def _sync_crd(cluster: Any) -> str:
    """What the operator does at start (crd_sync.ensure_current), with the operator's credentials."""
    import os
    import subprocess
    import sys

    code = "import asyncio, kopf; from dsv4_operator import crd_sync; from dsv4_operator.kube import Api\n"
    code += "async def main():\n    api = Api(); api.use(kopf.login_with_kubeconfig(settings=kopf.OperatorSettings()))\n"
    code += "    try: print(await crd_sync.ensure_current(api))\n    finally: await api.close()\n"
    code += "asyncio.run(main())"
    env = {**os.environ, "KUBECONFIG": str(cluster.operator_kubeconfig)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_the_crd_is_kept_current_and_never_downgraded(cluster: Any, operator: Any) -> None:
    """helm upgrade never touches crds/: the operator applies its CRD at start. An older CRD (one
    without spec.monitoring, an optional field added later) with a resource stored under it: the
    upgrade keeps that resource valid and reconciled, and the new field is accepted. A CRD from a
    newer operator is left as it is."""
    from dsv4_operator import crd_sync
    from dsv4_operator.crd import load_crd

    name, ann = crd_sync.CRD_NAME, crd_sync.VERSION_ANNOTATION
    ours = crd_sync.operator_version()
    # The fixture installs the CRD unstamped (as helm's crds/ does): an operator's start stamped it.
    assert cluster.get(f"crd/{name}")["metadata"]["annotations"][ann] == ours

    def crd_from(version: str) -> str:
        old = load_crd(cel=False)
        del old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
            "monitoring"
        ]
        old["metadata"]["annotations"] = {ann: version}
        old["metadata"]["resourceVersion"] = cluster.get(f"crd/{name}")["metadata"]["resourceVersion"]
        return yaml.safe_dump(old)

    def has_monitoring() -> bool:
        schema = cluster.get(f"crd/{name}")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        return "monitoring" in schema["properties"]["spec"]["properties"]

    ns = "crd-upgrade"
    cluster.kubectl("create", "namespace", ns)
    try:
        cluster.kubectl("replace", "-f", "-", input=crd_from("0.0.1"))
        assert not has_monitoring()
        body = load(ROOT / "examples" / "cpu-tiny.yaml", ns, "stored-old")
        apply(cluster, body)
        cluster.wait(
            lambda: rendered(body) <= set(children(cluster, ns, "stored-old")), 60, "reconciled, old CRD"
        )

        assert _sync_crd(cluster) == "applied"
        assert has_monitoring() and cluster.get(f"crd/{name}")["metadata"]["annotations"][ann] == ours
        cluster.kubectl("annotate", "dsv4", "stored-old", "-n", ns, "touched=1")  # still valid, still served
        newer = load(ROOT / "examples" / "cpu-tiny.yaml", ns, "uses-new-field")
        newer["spec"]["monitoring"] = {"podMonitor": {"enabled": False}}
        text = yaml.safe_dump(newer)

        def accepted() -> bool:
            return cluster.kubectl("apply", "-f", "-", input=text, check=False).returncode == 0

        # kubectl validates against the OpenAPI the API server republishes a moment after the CRD changes.
        cluster.wait(accepted, 60, "a resource using the new field to be accepted")
        cluster.wait(
            lambda: rendered(newer) <= set(children(cluster, ns, "uses-new-field")), 60, "reconciled"
        )
        assert _sync_crd(cluster) == "current"

        cluster.kubectl("delete", "dsv4", "uses-new-field", "-n", ns)
        cluster.kubectl("replace", "-f", "-", input=crd_from("999.0.0"))
        assert _sync_crd(cluster) == "newer" and not has_monitoring()  # a newer operator's: left alone
    finally:
        unstamped = load_crd(cel=False)
        unstamped["metadata"]["resourceVersion"] = cluster.get(f"crd/{name}")["metadata"]["resourceVersion"]
        cluster.kubectl("replace", "-f", "-", input=yaml.safe_dump(unstamped))
        assert _sync_crd(cluster) == "applied" and has_monitoring()
        cluster.kubectl("delete", "namespace", ns, "--wait=false")
