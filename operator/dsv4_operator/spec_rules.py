"""Cross-field rules of a `Dsv4Deployment` spec.

Each rule here has a twin among the CRD's `x-kubernetes-validations` (CEL) so a cluster with CEL
rejects what the webhook rejects; the drift test in tests/foundation/ holds them together. A rule
returns (field path, reason) and the reason says what to change.
"""

from __future__ import annotations

from pydantic.alias_generators import to_camel

from dsv4_operator.spec_types import (
    MAX_NPUS_PER_NODE,
    Dsv4Deployment,
    LabelSelector,
    RoleSpec,
    Toleration,
)

# Environment variables the rendered pods set themselves; a user value would silently lose.
RESERVED_ENV = (
    "DSV4_API_KEY",
    "DSV4_ROLE",
    "HCCL_IF_IP",
    "HCCL_SOCKET_IFNAME",
    "POD_IP",
    "POD_NAME",
    "POD_NAMESPACE",
)
# Set by the NPU device plugin (and its container runtime) for the NPUs the pod was given: a user value
# would point the engine at NPUs it was not allocated.
DEVICE_ENV = ("ASCEND_RT_VISIBLE_DEVICES", "ASCEND_VISIBLE_DEVICES")
BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"
# Which Mooncake transports can move KV out of which device's memory.
PROTOCOLS = {"cpu": ("tcp",), "npu": ("ascend",), "cuda": ("rdma", "tcp")}

Problems = list[tuple[str, str]]


def check(dep: Dsv4Deployment) -> Problems:
    spec = dep.spec
    out: Problems = []
    model = spec.model
    sources = [n for n, v in (("pvc", model.pvc), ("hostPath", model.host_path), ("image", model.image)) if v]
    if len(sources) != 1:
        got = ", ".join(sources) or "none"
        out.append(("spec.model", f"set exactly one model source of pvc, hostPath, image (got {got})"))

    eng = spec.engine
    if eng.chunked_prefill_size % eng.page_size:
        out.append(
            (
                "spec.engine.chunkedPrefillSize",
                f"must be a multiple of pageSize ({eng.page_size}); got {eng.chunked_prefill_size}",
            )
        )
    if eng.max_model_len < eng.chunked_prefill_size:
        out.append(
            (
                "spec.engine.maxModelLen",
                f"must be at least chunkedPrefillSize ({eng.chunked_prefill_size}); got {eng.max_model_len}",
            )
        )
    if eng.port == eng.bootstrap_port:
        out.append(("spec.engine.bootstrapPort", f"must differ from engine.port ({eng.port})"))
    if eng.prefix_cache_volume is not None and not eng.prefix_cache:
        out.append(("spec.engine.prefixCacheVolume", "keeps the prefix cache: set engine.prefixCache true"))
    allowed = PROTOCOLS[eng.device]
    if eng.transfer_protocol not in allowed:
        out.append(
            (
                "spec.engine.transferProtocol",
                f"{eng.transfer_protocol} cannot move KV on device {eng.device}; use {' or '.join(allowed)}",
            )
        )
    seen: set[str] = set()
    for i, env in enumerate(eng.env or []):
        if env.name in RESERVED_ENV:
            out.append(
                (f"spec.engine.env[{i}].name", f"{env.name} is set by the operator and cannot be overridden")
            )
        if env.name in DEVICE_ENV:
            out.append(
                (
                    f"spec.engine.env[{i}].name",
                    f"{env.name} is set by the NPU device plugin for the NPUs allocated to the pod",
                )
            )
        if env.name in seen:
            out.append((f"spec.engine.env[{i}].name", f"duplicate environment variable {env.name}"))
        seen.add(env.name)

    for role in ("prefill", "decode"):
        out += _role(f"spec.{role}", getattr(spec, role), eng.device)
    if (spec.prefill.replicas == 0) != (spec.decode.replicas == 0):
        zero = "prefill" if spec.prefill.replicas == 0 else "decode"
        out.append(
            (
                f"spec.{zero}.replicas",
                "prefill and decode replicas must both be 0 (paused) or both at least 1: "
                "one role alone cannot serve",
            )
        )

    router = spec.router
    if router.port == router.metrics_port:
        out.append(("spec.router.metricsPort", f"must differ from router.port ({router.port})"))
    out += _tolerations("spec.router", router.tolerations)

    mon = spec.monitoring
    for other, field in ((eng.port, "engine.port"), (eng.bootstrap_port, "engine.bootstrapPort")):
        if mon.metrics_port == other:
            out.append(("spec.monitoring.metricsPort", f"must differ from {field} ({other})"))
    if mon.scraper is not None:
        if mon.scraper.namespace_selector is None and mon.scraper.pod_selector is None:
            out.append(
                ("spec.monitoring.scraper", "set namespaceSelector, podSelector or both (who may scrape)")
            )
        for name in ("namespace_selector", "pod_selector"):
            out += _selector(f"spec.monitoring.scraper.{to_camel(name)}", getattr(mon.scraper, name))

    if spec.service.node_port is not None and spec.service.type == "ClusterIP":
        out.append(("spec.service.nodePort", "only a NodePort or LoadBalancer service takes a nodePort"))
    if spec.pod_annotations and BOOTSTRAP_ANNOTATION in spec.pod_annotations:
        out.append(("spec.podAnnotations", f"{BOOTSTRAP_ANNOTATION} is set from engine.bootstrapPort"))
    return out


def _role(path: str, role: RoleSpec, device: str) -> Problems:
    out: Problems = []
    npus, tp = role.npus_per_pod, role.tensor_parallel_size
    if npus > MAX_NPUS_PER_NODE:
        out.append(
            (
                f"{path}.npusPerPod",
                f"{npus} is more than one node holds (at most {MAX_NPUS_PER_NODE}): "
                "multi-node servers are not supported yet",
            )
        )
    elif device == "cpu" and npus != 0:
        out.append((f"{path}.npusPerPod", "must be 0 when engine.device is cpu"))
    elif device != "cpu" and npus == 0:
        out.append((f"{path}.npusPerPod", f"must be at least 1 when engine.device is {device}"))
    elif device != "cpu" and tp > npus:
        out.append(
            (
                f"{path}.tensorParallelSize",
                f"a server of tensorParallelSize {tp} needs {tp} NPUs but a pod has npusPerPod {npus}: "
                "a server spanning pods or nodes (multi-node) is not supported yet",
            )
        )
    elif device != "cpu" and tp < npus:
        out.append(
            (
                f"{path}.npusPerPod",
                f"must equal tensorParallelSize ({tp}): each pod runs one server on tensorParallelSize "
                f"NPUs, so {npus - tp} of {npus} would sit idle",
            )
        )
    if tp % role.expert_parallel_size:
        out.append(
            (
                f"{path}.expertParallelSize",
                f"must divide tensorParallelSize ({tp}); got {role.expert_parallel_size}",
            )
        )
    res = role.resources
    for kind in ("requests", "limits"):
        if res and getattr(res, kind) and role.npu_resource_name in getattr(res, kind):
            out.append(
                (
                    f"{path}.resources.{kind}",
                    f"must not name {role.npu_resource_name}: set npusPerPod instead",
                )
            )
    return out + _tolerations(path, role.tolerations)


def _selector(path: str, selector: LabelSelector | None) -> Problems:
    out: Problems = []
    for i, req in enumerate((selector.match_expressions if selector else None) or []):
        wants_values = req.operator in ("In", "NotIn")
        if wants_values != bool(req.values):
            need = "needs values" if wants_values else "takes no values"
            out.append((f"{path}.matchExpressions[{i}].values", f"operator {req.operator} {need}"))
    return out


def _tolerations(path: str, tolerations: list[Toleration] | None) -> Problems:
    out: Problems = []
    for i, t in enumerate(tolerations or []):
        at = f"{path}.tolerations[{i}]"
        if t.operator == "Exists" and t.value:
            out.append((f"{at}.value", "must be empty when operator is Exists"))
        if not t.key and t.operator != "Exists":
            out.append((f"{at}.operator", "must be Exists when key is empty (tolerate every taint)"))
        if t.toleration_seconds is not None and t.effect != "NoExecute":
            out.append((f"{at}.tolerationSeconds", "only applies with effect NoExecute"))
    return out
