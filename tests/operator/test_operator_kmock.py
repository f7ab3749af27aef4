"""The operator end to end on kmock's emulated API: kopf.operator() runs in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import pathlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import kmock
import kopf
import pytest
import yaml

from dsv4_operator import handlers, manifests, metrics, spec
from dsv4_operator.config import Config
from dsv4_operator.fingerprint import deployment_fingerprint
from dsv4_operator.kube import Api

GROUP, VERSION, PLURAL = handlers.GROUP, handlers.VERSION, handlers.PLURAL
WRITE_METHODS = {"POST", "PATCH", "PUT", "DELETE"}


class ApplyingEmulator(kmock.KubernetesEmulator):
    """kmock stores JSON merges only; a server-side apply to an absent object creates it, as the API
    server does. Uids, generations and resourceVersions are filled in on create. (Uses kmock 0.8's
    private store and buses; the version is pinned in pyproject.toml.)"""

    _counter = 0

    @classmethod
    def _stamp(cls, obj: dict) -> dict:
        cls._counter += 1
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{cls._counter}"
        meta.setdefault("uid", f"uid-{cls._counter}")
        meta.setdefault("resourceVersion", "1")  # constant: kmock does not version; kopf's tests pass
        meta.setdefault("generation", 1)
        return obj

    async def _handle(self, request: Any) -> Any:
        method = str(request.method).split(".")[-1]
        if request.resource is not None and method == "POST" and isinstance(request.data, dict):
            self._stamp(request.data)
        if (
            request.resource is not None and request.name and not request.subresource and method == "PATCH"
            and "apply-patch" in request.headers.get("Content-Type", "")
        ):  # fmt: skip
            key = (request.resource, request.namespace, request.name)
            async with self._lock:
                if key not in self._objects or self._objects[key].deleted:
                    obj = self._stamp(copy.deepcopy(request.data))
                    if key in self._objects:
                        self._objects[key].create(obj)
                    else:
                        self._objects[key] = obj
                    await self._buses[request.resource].put({"type": "ADDED", "object": obj})
        return await super()._handle(request)


def writes(emulator: Any, since: int = 0) -> list[Any]:
    """Write requests the emulator received (events excluded: they are reported separately)."""
    return [r for r in list(emulator)[since:] if str(r.method).split(".")[-1] in WRITE_METHODS]


def write_paths(reqs: list[Any]) -> list[str]:
    return [f"{str(r.method).split('.')[-1]} {r.url.path}" for r in reqs if "/events" not in r.url.path]


async def eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll `check` until it returns something truthy (and return that), or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture()
def emulator(kmock: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    kmock.resources.load_bundled()
    kmock.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = {
        "kind": "Dsv4Deployment", "namespaced": True, "singular": "dsv4deployment",
        "verbs": ["get", "list", "watch", "create", "patch", "update", "delete"],
        "shortnames": ["dsv4"], "categories": [], "subresources": ["status", "scale"],
    }  # fmt: skip
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "kmock",
                "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
                "users": [{"name": "kmock", "user": {"token": "test"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return kmock


@contextlib.asynccontextmanager
async def running_operator(config: Config) -> AsyncIterator[kopf.Memo]:
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    settings.watching.reconnect_backoff = 0.1
    settings.queueing.exit_timeout = 0.2  # quick teardown: nothing is left to process at the end
    settings.background.instant_exit_timeout = 0.5
    memo = kopf.Memo(config=config)
    task = asyncio.create_task(
        kopf.operator(
            registry=kopf.get_default_registry(),
            settings=settings,
            memo=memo,
            namespaces=["default"],
            standalone=True,
        )
    )
    try:
        await eventually(lambda: "api" in memo or task.done(), what="operator start")
        if task.done():
            task.result()
        yield memo
    finally:
        # Cancelled rather than flagged: kopf would otherwise wait 5 s for every task born after
        # its start, the emulator's open watch handlers included.
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=15)


@pytest.fixture()
async def operator(emulator: Any) -> AsyncIterator[kopf.Memo]:
    logging.getLogger("kopf").setLevel(logging.WARNING)
    logging.getLogger("kopf.objects").setLevel(logging.INFO)
    async with running_operator(Config(resync_seconds=0.5, manage_crd=False, drain_seconds=0)) as memo:
        yield memo


pytestmark = [pytest.mark.kmock(cls=ApplyingEmulator), pytest.mark.timeout(60)]

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "minimal.yaml"
NS, NAME = "default", "demo"
CR = ("dsv4.ai/v1alpha1", "Dsv4Deployment")


def resource(**spec_changes: Any) -> dict:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": NAME, "namespace": NS, "generation": 1}
    body["spec"].update(spec_changes)
    return body


def rendered_keys(body: dict) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in manifests.render(spec.parse(body))}


@pytest.fixture()
async def api(emulator: Any) -> AsyncIterator[Api]:
    """The test's own client (its writes are not the operator's)."""
    client = Api()
    client.use(kopf.ConnectionInfo(server=str(emulator.url).rstrip("/")))
    yield client
    await client.close()


def stored(emulator: Any, kind: str, name: str) -> dict | None:
    for (res, ns, nm), obj in emulator.objects.items():
        if nm == name and ns == NS and not obj.deleted and res.plural == kind.lower() + "s":
            return obj.raw
    return None


def children(emulator: Any) -> dict[tuple[str, str], dict]:
    out = {}
    for (_, ns, name), obj in emulator.objects.items():
        raw = obj.raw if not obj.deleted else None
        if raw and ns == NS and (raw["metadata"].get("labels") or {}).get("dsv4.ai/deployment") == NAME:
            out[(raw["kind"], name)] = raw
    return out


def condition(emulator: Any, type_: str) -> dict:
    cr = stored(emulator, "Dsv4Deployment", NAME) or {}
    return {c["type"]: c for c in (cr.get("status") or {}).get("conditions") or []}.get(type_, {})


async def make_ready(api: Api, emulator: Any, fp: str) -> None:
    """What the StatefulSet and Deployment controllers report once every pod is Ready."""
    for (kind, _), obj in children(emulator).items():
        if (
            kind in ("StatefulSet", "Deployment")
            and obj["metadata"]["labels"].get("dsv4.ai/fingerprint") == fp
        ):
            n = obj["spec"].get("replicas", 1)
            await api.patch_status(obj, {"replicas": n, "readyReplicas": n, "updatedReplicas": n})


async def rounds(memo: kopf.Memo, n: int) -> None:
    """Wait until the resource's reconcile loop has completed `n` more rounds."""
    start = memo.wakeups.rounds.get((NS, NAME), 0)
    await eventually(lambda: memo.wakeups.rounds.get((NS, NAME), 0) >= start + n, what=f"{n} rounds")


async def converged(api: Api, emulator: Any, body: dict) -> str:
    fp = deployment_fingerprint(spec.parse(body))
    await eventually(lambda: rendered_keys(body) <= set(children(emulator)), what="children applied")
    await make_ready(api, emulator, fp)
    await eventually(lambda: condition(emulator, "Ready").get("status") == "True", what="Ready")
    return fp


async def test_children_are_applied_owned_and_reported(emulator: Any, operator: kopf.Memo, api: Api) -> None:
    body = resource()
    await api.create(body)
    await eventually(lambda: rendered_keys(body) <= set(children(emulator)), what="children applied")
    cr = stored(emulator, "Dsv4Deployment", NAME)
    for obj in children(emulator).values():
        refs = obj["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "dsv4.ai/v1alpha1", "kind": "Dsv4Deployment", "name": NAME,
                         "uid": cr["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]  # fmt: skip
        assert "dsv4.ai/applied-hash" in obj["metadata"]["annotations"]
    applies = [r for r in writes(emulator) if "apply-patch" in r.headers.get("Content-Type", "")]
    assert applies and all(r.params.get("fieldManager") == "dsv4-operator" for r in applies)
    await eventually(lambda: condition(emulator, "Ready").get("reason") == "RolesNotReady", what="status")
    fp = await converged(api, emulator, body)
    status = stored(emulator, "Dsv4Deployment", NAME)["status"]
    assert status["observedGeneration"] == 1
    assert status["fingerprint"] == status["servingFingerprint"] == fp
    assert status["endpoint"].startswith(f"http://{NAME}.{NS}.svc:")
    assert status["decode"]["readyReplicas"] == 1
    assert condition(emulator, "Progressing")["reason"] == "Complete"
    assert metrics.RECONCILES.labels(result="ok")._value.get() > 0
    # What the alert rules read: the conditions and the serving generation's ready replicas.
    gauge = metrics.REGISTRY.get_sample_value
    mine = {"dsv4_namespace": NS, "dsv4_deployment": NAME}
    await eventually(lambda: gauge("dsv4_operator_resource_condition", {**mine, "type": "Ready"}) == 1)
    assert gauge("dsv4_operator_resource_condition", {**mine, "type": "Degraded"}) == 0
    for role in ("prefill", "decode", "router"):
        labels = {**mine, "role": role}
        assert gauge("dsv4_operator_role_replicas", labels) == 1
        assert gauge("dsv4_operator_role_ready_replicas", labels) == 1


async def test_a_resync_that_changes_nothing_writes_nothing(
    emulator: Any, operator: kopf.Memo, api: Api
) -> None:
    await api.create(resource())
    await converged(api, emulator, resource())
    await rounds(operator, 1)
    before = len(list(emulator))
    await rounds(operator, 3)  # three full reconciles (resync period 0.5 s)
    assert write_paths(writes(emulator, before)) == []


async def test_deleted_or_edited_child_is_restored(emulator: Any, operator: kopf.Memo, api: Api) -> None:
    body = resource()
    await api.create(body)
    await converged(api, emulator, body)
    sts = next(o for (k, _), o in children(emulator).items() if k == "StatefulSet")
    name = sts["metadata"]["name"]
    await api.delete(sts)
    await eventually(lambda: ("StatefulSet", name) in children(emulator), what="deleted child restored")
    hacked = copy.deepcopy(children(emulator)[("StatefulSet", name)])
    hacked["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
    await api._call("PATCH", f"/apis/apps/v1/namespaces/{NS}/statefulsets/{name}", body={"spec": hacked["spec"]},
                    content_type="application/merge-patch+json")  # fmt: skip

    def image() -> str:
        return children(emulator)[("StatefulSet", name)]["spec"]["template"]["spec"]["containers"][0]["image"]

    await eventually(lambda: image() == body["spec"]["image"], what="edited child restored")


async def test_nothing_is_created_while_the_resource_is_deleted(
    emulator: Any, operator: kopf.Memo, api: Api
) -> None:
    await api.create(resource())
    await converged(api, emulator, resource())
    cr = stored(emulator, "Dsv4Deployment", NAME)
    # Foreground deletion: the API server sets deletionTimestamp and keeps the object while a finalizer remains.
    await api._call("PATCH", f"/apis/dsv4.ai/v1alpha1/namespaces/{NS}/dsv4deployments/{NAME}",
                    body={"metadata": {"finalizers": ["foregroundDeletion", "dsv4.ai/kopf-finalizer"]}},
                    content_type="application/merge-patch+json")  # fmt: skip
    await api.delete(cr)
    await eventually(lambda: stored(emulator, "Dsv4Deployment", NAME)["metadata"].get("deletionTimestamp"))
    sts = next(o for (k, _), o in children(emulator).items() if k == "StatefulSet")
    await api.delete(sts)
    before = len(list(emulator))

    def released() -> bool:  # kopf stopped the resource's loop and dropped its own finalizer
        return (
            "dsv4.ai/kopf-finalizer" not in stored(emulator, "Dsv4Deployment", NAME)["metadata"]["finalizers"]
        )

    await eventually(released, what="the reconcile loop to stop")
    # A deleted resource leaves no series behind.
    labels = {"dsv4_namespace": NS, "dsv4_deployment": NAME, "type": "Ready"}
    gauge = metrics.REGISTRY.get_sample_value
    await eventually(lambda: gauge("dsv4_operator_resource_condition", labels) is None)
    assert ("StatefulSet", sts["metadata"]["name"]) not in children(emulator)
    assert write_paths(writes(emulator, before)) == [
        f"PATCH /apis/dsv4.ai/v1alpha1/namespaces/{NS}/dsv4deployments/{NAME}"
    ]


async def test_scaling_one_role_leaves_the_others_alone(emulator: Any, operator: kopf.Memo, api: Api) -> None:
    body = resource()
    await api.create(body)
    fp = await converged(api, emulator, body)
    before = len(list(emulator))
    cr = stored(emulator, "Dsv4Deployment", NAME)
    new_spec = {**cr["spec"], "prefill": {**(cr["spec"].get("prefill") or {}), "replicas": 3}}
    await api._call("PATCH", f"/apis/dsv4.ai/v1alpha1/namespaces/{NS}/dsv4deployments/{NAME}",
                    body={"spec": new_spec, "metadata": {"generation": 2}},
                    content_type="application/merge-patch+json")  # fmt: skip
    prefill = f"{NAME}-prefill-{fp}"
    await eventually(lambda: children(emulator)[("StatefulSet", prefill)]["spec"]["replicas"] == 3)
    await eventually(lambda: stored(emulator, "Dsv4Deployment", NAME)["status"]["observedGeneration"] == 2)
    touched = write_paths(writes(emulator, before))
    assert any(prefill in p for p in touched)
    assert not any(f"{NAME}-decode-" in p or f"{NAME}-router-" in p for p in touched), touched
    assert deployment_fingerprint(spec.parse({**body, "spec": new_spec})) == fp


async def test_fingerprint_change_rolls_a_new_generation(
    emulator: Any, operator: kopf.Memo, api: Api
) -> None:
    body = resource()
    await api.create(body)
    old = await converged(api, emulator, body)
    changed = resource(image="registry.example.com/dsv4/engine-ascend:0.2.0")
    new = deployment_fingerprint(spec.parse(changed))
    assert new != old
    await api._call("PATCH", f"/apis/dsv4.ai/v1alpha1/namespaces/{NS}/dsv4deployments/{NAME}",
                    body={"spec": changed["spec"], "metadata": {"generation": 2}},
                    content_type="application/merge-patch+json")  # fmt: skip
    await eventually(
        lambda: ("StatefulSet", f"{NAME}-decode-{new}") in children(emulator), what="new generation"
    )
    selector = lambda: children(emulator)[("Service", NAME)]["spec"]["selector"]["dsv4.ai/fingerprint"]  # noqa: E731
    # Not ready yet: the old generation keeps serving; pods that cannot be placed are reported.
    assert selector() == old and ("StatefulSet", f"{NAME}-decode-{old}") in children(emulator)
    await api.create({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{NAME}-decode-{new}-0", "namespace": NS,
                     "labels": {"dsv4.ai/deployment": NAME, "dsv4.ai/fingerprint": new, "dsv4.ai/role": "decode"}},
        "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                   "message": "0/2 nodes are available: 2 Insufficient huawei.com/Ascend910."}]},
    })  # fmt: skip
    await eventually(lambda: condition(emulator, "Progressing").get("reason") == "InsufficientCapacity")
    assert "Insufficient huawei.com/Ascend910" in condition(emulator, "Progressing")["message"]
    assert condition(emulator, "Ready")["status"] == "True"
    await make_ready(api, emulator, new)
    await eventually(lambda: selector() == new, what="endpoint moved")
    await eventually(
        lambda: not any(old in name for _, name in children(emulator)), what="old generation deleted"
    )
    assert rendered_keys(changed) <= set(children(emulator))


async def test_invalid_spec_is_reported_not_applied(emulator: Any, operator: kopf.Memo, api: Api) -> None:
    body = resource()
    body["spec"]["engine"] = {"pageSize": 100}  # the webhook would refuse it; here it is bypassed
    await api.create(body)
    await eventually(lambda: condition(emulator, "Degraded").get("reason") == "InvalidSpec")
    assert "pageSize" in condition(emulator, "Degraded")["message"]
    assert children(emulator) == {}


async def test_rejected_child_is_reported_as_degraded(emulator: Any, operator: kopf.Memo, api: Api) -> None:
    # An admission webhook on StatefulSets (a policy engine, say) refuses what the operator applies.
    message = 'admission webhook "policy.example.com" denied the request: hostPath volumes are not allowed'
    emulator["patch", emulator.resource("apps", "v1", "statefulsets")] << 422 << {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid", "code": 422, "message": message,
    }  # fmt: skip
    await api.create(resource())
    await eventually(
        lambda: condition(emulator, "Degraded").get("reason") == "ApplyRejected", what="Degraded"
    )
    assert message in condition(emulator, "Degraded")["message"]
    assert "StatefulSet/" in condition(emulator, "Degraded")["message"]
    labels = {"dsv4_namespace": NS, "dsv4_deployment": NAME, "type": "Degraded"}
    assert metrics.REGISTRY.get_sample_value("dsv4_operator_resource_condition", labels) == 1


async def test_an_rbac_without_pod_monitors_still_reconciles(
    emulator: Any, operator: kopf.Memo, api: Api
) -> None:
    # An older chart's ClusterRole: listing PodMonitors is forbidden; everything else goes on.
    emulator["get", emulator.resource("monitoring.coreos.com", "v1", "podmonitors")] << 403 << {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
        "message": "podmonitors.monitoring.coreos.com is forbidden",
    }  # fmt: skip
    body = resource()
    await api.create(body)
    await converged(api, emulator, body)
    assert condition(emulator, "Degraded").get("status") == "False"


POD_MONITORS = {
    "kind": "PodMonitor", "namespaced": True, "singular": "podmonitor", "shortnames": [], "categories": [],
    "verbs": ["get", "list", "watch", "create", "patch", "update", "delete"], "subresources": [],
}  # fmt: skip


async def test_pod_monitor_follows_the_spec(emulator: Any, operator: kopf.Memo, api: Api) -> None:
    emulator.resources["monitoring.coreos.com/v1/podmonitors"] = POD_MONITORS  # the Prometheus Operator's CRD
    body = resource(monitoring={"podMonitor": {"enabled": True, "labels": {"release": "kps"}}})
    await api.create(body)
    await eventually(lambda: ("PodMonitor", NAME) in children(emulator), what="PodMonitor applied")
    pm = children(emulator)[("PodMonitor", NAME)]
    assert pm["metadata"]["labels"]["release"] == "kps"
    assert pm["metadata"]["ownerReferences"][0]["name"] == NAME
    cr = stored(emulator, "Dsv4Deployment", NAME)
    await api._call("PATCH", f"/apis/dsv4.ai/v1alpha1/namespaces/{NS}/dsv4deployments/{NAME}",
                    body={"spec": {**cr["spec"], "monitoring": {"podMonitor": {"enabled": False}}}},
                    content_type="application/merge-patch+json")  # fmt: skip
    await eventually(lambda: ("PodMonitor", NAME) not in children(emulator), what="PodMonitor pruned")
    assert ("NetworkPolicy", f"{NAME}-workers") in children(emulator)


async def test_a_pod_monitor_the_cluster_cannot_store_is_reported_and_never_sent(
    emulator: Any, operator: kopf.Memo, api: Api
) -> None:
    """No Prometheus Operator: everything else is applied, Degraded names the PodMonitor, and a resync
    sends nothing for it (the operator asks discovery, instead of retrying the apply every resync)."""
    await api.create(resource(monitoring={"podMonitor": {"enabled": True}}))
    await eventually(
        lambda: condition(emulator, "Degraded").get("reason") == "KindNotServed", what="Degraded"
    )
    assert f"PodMonitor/{NAME}" in condition(emulator, "Degraded")["message"]
    assert ("NetworkPolicy", f"{NAME}-workers") in children(emulator)
    await rounds(operator, 1)
    before = len(list(emulator))
    await rounds(operator, 3)
    assert write_paths(writes(emulator, before)) == []
    assert not [r for r in list(emulator) if "podmonitors" in r.url.path and str(r.method).endswith("PATCH")]
