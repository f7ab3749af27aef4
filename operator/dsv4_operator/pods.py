"""Pod templates: the prefill/decode StatefulSets and the router Deployment."""

from __future__ import annotations

from typing import Any

from dsv4_operator.plan import (
    A_BOOTSTRAP_PORT,
    COMPILE_CACHE_MOUNT,
    CONFIG_MOUNT,
    MODEL_MOUNT,
    PREFIX_CACHE_MOUNT,
    PROBE_PERIOD_SECONDS,
    Plan,
    RolePlan,
    stop_seconds,
)
from dsv4_operator.spec import Dsv4Deployment, Resources, RoleSpec, RouterSpec

Obj = dict[str, Any]


def _field_env(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _pod_security(dep: Dsv4Deployment, groups: list[int] | None = None) -> Obj:
    ps = dep.spec.pod_security
    return {
        "runAsNonRoot": True,
        "runAsUser": ps.run_as_user,
        "runAsGroup": ps.run_as_group,
        "fsGroup": ps.fs_group,
        **({"supplementalGroups": groups} if groups else {}),
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security(read_only_root: bool) -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": read_only_root,
    }


def _model_volume(dep: Dsv4Deployment) -> list[Obj]:
    model = dep.spec.model
    if model.pvc is not None:
        return [
            {"name": "model", "persistentVolumeClaim": {"claimName": model.pvc.claim_name, "readOnly": True}}
        ]
    if model.host_path is not None:
        return [{"name": "model", "hostPath": {"path": model.host_path.path, "type": "Directory"}}]
    return []  # baked into the image


def _model_mount(dep: Dsv4Deployment) -> list[Obj]:
    return [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}] if _model_volume(dep) else []


def _http_probe(path: str, period: int, timeout: int, failures: int) -> Obj:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _resources(resources: Resources | None, npus: int = 0, npu_name: str = "") -> Obj:
    res = resources.model_dump(by_alias=True, exclude_none=True) if resources else {}
    if npus:  # extended resources: requests must equal limits
        res = {k: {**res.get(k, {}), npu_name: npus} for k in ("requests", "limits")}
    # Quantities as strings, the API's canonical form: server-side apply on 1.20 rejects integers.
    return {k: {q: str(n) for q, n in sorted(v.items())} for k, v in sorted(res.items())}


def _placement(role: RoleSpec | RouterSpec) -> Obj:
    out: Obj = {}
    if role.node_selector:
        out["nodeSelector"] = dict(sorted(role.node_selector.items()))
    if role.tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in role.tolerations]
    if getattr(role, "affinity", None):
        out["affinity"] = role.affinity
    if getattr(role, "priority_class_name", None):
        out["priorityClassName"] = role.priority_class_name
    return out


def _pull_secrets(dep: Dsv4Deployment) -> Obj:
    secrets = dep.spec.image_pull_secrets or []
    return {"imagePullSecrets": [{"name": s.name} for s in secrets]} if secrets else {}


# What the Ascend Docker Runtime would inject, mounted from the node when it does not (mountDriver):
# the driver, DCMI and npu-smi (device queries), and the install record CANN reads.
ASCEND_HOST_FILES = (
    ("ascend-dcmi", "/usr/local/dcmi", "Directory"),
    ("npu-smi", "/usr/local/bin/npu-smi", "File"),
    ("ascend-install-info", "/etc/ascend_install.info", "File"),
)


def _ascend_host_paths(dep: Dsv4Deployment) -> list[tuple[str, str, str]]:
    """(volume name, node path mounted read-only at the same path, hostPath type) for NPU servers."""
    asc = dep.spec.ascend
    out = [("hccn-conf", asc.hccn_conf_path, "File")] if asc.mount_hccn_conf else []
    if asc.mount_driver:
        out += [("ascend-driver", asc.driver_path, "Directory"), *ASCEND_HOST_FILES]
    return out


def worker_statefulset(dep: Dsv4Deployment, p: Plan, rp: RolePlan, meta: Obj) -> Obj:
    spec, eng = dep.spec, dep.spec.engine
    role: RoleSpec = getattr(spec, rp.role)
    npu = eng.device != "cpu"  # an accelerator (NPU or GPU): the pod requests npusPerPod of it
    ascend, asc = eng.device == "npu", spec.ascend
    env = [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_IP", "status.podIP"),
        {"name": "DSV4_ROLE", "value": rp.role},
    ]
    if ascend:
        env += [
            _field_env("HCCL_IF_IP", "status.podIP"),
            {"name": "HCCL_SOCKET_IFNAME", "value": asc.hccl_socket_ifname},
        ]
    env += [{"name": e.name, "value": e.value or ""} for e in eng.env or []]
    volumes: list[Obj] = [
        *_model_volume(dep),
        {"name": "engine-config", "configMap": {"name": p.config_map}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(role.shared_memory_size)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[Obj] = [
        *_model_mount(dep),
        {"name": "engine-config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if rp.role == "prefill" and eng.prefix_cache_volume is not None:
        # Written by a draining server, read by a starting one (server/prefix_file.py).
        claim = {"claimName": eng.prefix_cache_volume.claim_name}
        volumes.append({"name": "prefix-cache", "persistentVolumeClaim": claim})
        mounts.append({"name": "prefix-cache", "mountPath": PREFIX_CACHE_MOUNT})
    if not eng.enforce_eager:
        # A pod's emptyDir outlives its container: a restarted engine loads its compiled decode steps
        # instead of compiling them again. torch keys them by graph and version itself.
        volumes.append({"name": "compile-cache", "emptyDir": {}})
        mounts.append({"name": "compile-cache", "mountPath": COMPILE_CACHE_MOUNT})
        env.append({"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{COMPILE_CACHE_MOUNT}/inductor"})
    for vol, path, kind in _ascend_host_paths(dep) if ascend else ():
        volumes.append({"name": vol, "hostPath": {"path": path, "type": kind}})
        mounts.append({"name": vol, "mountPath": path, "readOnly": True})
    annotations = dict(sorted((spec.pod_annotations or {}).items()))
    if rp.role == "prefill":
        annotations[A_BOOTSTRAP_PORT] = str(eng.bootstrap_port)
    container: Obj = {
        "name": "engine",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(rp.command),
        "args": list(rp.args),
        "ports": [{"name": k, "containerPort": v, "protocol": "TCP"} for k, v in rp.ports.items()],
        "env": env,
        "resources": _resources(role.resources, role.npus_per_pod if npu else 0, role.npu_resource_name),
        "volumeMounts": mounts,
        # Model loads take many minutes: only the startup probe waits that long.
        "startupProbe": _http_probe("/health", PROBE_PERIOD_SECONDS, 5, p.startup_failure_threshold),
        "readinessProbe": _http_probe("/health", PROBE_PERIOD_SECONDS, 5, 3),
        "livenessProbe": _http_probe("/health", 30, 10, 5),
        # CANN writes kernel caches and logs under the working and home directories.
        "securityContext": _container_security(read_only_root=False),
    }
    pod_spec: Obj = {
        "automountServiceAccountToken": False,  # servers never talk to the API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": stop_seconds(dep, rp.role),
        # The driver's devices and files belong to HwHiAiUser's group on the node.
        "securityContext": _pod_security(dep, [asc.driver_group_id] if ascend else None),
        # In the node's namespace the pod still resolves cluster names (ClusterFirst alone would not).
        **(
            {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
            if ascend and asc.host_network
            else {}
        ),
        **_pull_secrets(dep),
        **_placement(role),
        "containers": [container],
        "volumes": volumes,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "serviceName": rp.name,
            "replicas": rp.replicas,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": rp.selector},
            "template": {
                "metadata": {"labels": rp.labels, **({"annotations": annotations} if annotations else {})},
                "spec": pod_spec,
            },
        },
    }


def router_deployment(dep: Dsv4Deployment, p: Plan, meta: Obj) -> Obj:
    spec, rp = dep.spec, p.router
    env = [_field_env("POD_NAMESPACE", "metadata.namespace")]
    if spec.api_key_secret:
        ref = {"name": spec.api_key_secret.name, "key": spec.api_key_secret.key}
        env.append({"name": "DSV4_API_KEY", "valueFrom": {"secretKeyRef": ref}})
    container: Obj = {
        "name": "router",
        "image": spec.router.image or spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(rp.command),
        "args": list(rp.args),
        "ports": [{"name": k, "containerPort": v, "protocol": "TCP"} for k, v in rp.ports.items()],
        "env": env,
        "resources": _resources(spec.router.resources),
        "volumeMounts": [*_model_mount(dep), {"name": "tmp", "mountPath": "/tmp"}],
        # /readiness answers 503 until the router has healthy servers: the endpoint only lists
        # routers that can serve.
        "readinessProbe": _http_probe("/readiness", 5, 5, 3),
        "livenessProbe": _http_probe("/liveness", 10, 5, 6),
        "securityContext": _container_security(read_only_root=True),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": rp.replicas,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "selector": {"matchLabels": rp.selector},
            "template": {
                "metadata": {"labels": rp.labels},
                "spec": {
                    "serviceAccountName": p.router_account,
                    "enableServiceLinks": False,
                    "securityContext": _pod_security(dep),
                    **_pull_secrets(dep),
                    **_placement(spec.router),
                    "containers": [container],
                    "volumes": [*_model_volume(dep), {"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }
