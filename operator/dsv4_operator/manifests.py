"""plan -> every Kubernetes child object of a Dsv4Deployment, in a fixed order, without owner
references (the operator adopts them).

Generation-scoped children carry the deployment fingerprint in their name and the
`dsv4.ai/fingerprint` label: the engine ConfigMap, per role a headless Service, a StatefulSet
(prefill, decode) or Deployment (router), and a PodDisruptionBudget. Shared children have neither and
outlive generations: the router's ServiceAccount, Role and RoleBinding, the endpoint Service (named
after the resource; it selects the routers of `serving_fingerprint`), the NetworkPolicy and, when
asked for, the PodMonitor.
"""

from __future__ import annotations

import copy
import shlex
from typing import Any

import yaml

from dsv4_operator.fingerprint import fingerprint_inputs
from dsv4_operator.plan import (
    APP,
    L_COMPONENT,
    L_DEPLOYMENT,
    L_FINGERPRINT,
    L_NAME,
    L_ROLE,
    POD_MONITOR_API,
    PORT_METRICS,
    Plan,
    RolePlan,
    common_labels,
    plan,
)
from dsv4_operator.pods import router_deployment, worker_statefulset
from dsv4_operator.spec import Dsv4Deployment

Obj = dict[str, Any]


def _meta(p: Plan, name: str, labels: dict[str, str], annotations: dict[str, str] | None = None) -> Obj:
    meta: Obj = {"name": name, "namespace": p.namespace, "labels": dict(sorted(labels.items()))}
    if annotations:
        meta["annotations"] = dict(sorted(annotations.items()))
    return meta


def _generation_labels(p: Plan) -> dict[str, str]:
    return common_labels(p.name) | {L_FINGERPRINT: p.fingerprint}


def engine_config(dep: Dsv4Deployment, p: Plan) -> Obj:
    """The engine configuration of this generation, for people and tools (`kubectl get cm`); the
    servers also see it under /etc/dsv4."""
    config = {
        "fingerprint": p.fingerprint,
        "fingerprintInputs": fingerprint_inputs(dep),
        "modelPath": p.model_path,
        "servedModelName": dep.spec.model.served_model_name,
        "engine": dep.spec.engine.model_dump(by_alias=True, exclude_none=True, mode="json"),
    }
    data = {"engine.yaml": yaml.safe_dump(config, sort_keys=True)}
    for rp in (p.prefill, p.decode):
        data[f"{rp.role}.command"] = shlex.join([*rp.command, *rp.args]) + "\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(p, p.config_map, _generation_labels(p)),
        "data": data,
    }


def headless_service(p: Plan, rp: RolePlan) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(p, rp.name, rp.labels),
        "spec": {
            "clusterIP": "None",
            "selector": rp.selector,
            "ports": [
                {"name": k, "port": v, "targetPort": k, "protocol": "TCP"} for k, v in rp.ports.items()
            ],
        },
    }


def endpoint_service(dep: Dsv4Deployment, p: Plan) -> Obj:
    svc = dep.spec.service
    port: Obj = {"name": "http", "port": svc.port, "targetPort": "http", "protocol": "TCP"}
    if svc.node_port is not None:
        port["nodePort"] = svc.node_port
    selector = {**p.router.selector, L_FINGERPRINT: p.serving_fingerprint}
    labels = common_labels(p.name) | {L_COMPONENT: "router", L_ROLE: "router"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(p, p.endpoint_service, labels, svc.annotations),
        "spec": {"type": svc.type, "selector": dict(sorted(selector.items())), "ports": [port]},
    }


def router_rbac(p: Plan) -> list[Obj]:
    """The router watches pods in its namespace to find servers; nothing more."""
    labels = common_labels(p.name) | {L_COMPONENT: "router", L_ROLE: "router"}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(p, p.router_account, labels)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(p, p.router_account, labels),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(p, p.router_account, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": p.router_account},
            "subjects": [{"kind": "ServiceAccount", "name": p.router_account, "namespace": p.namespace}],
        },
    ]


def pdb(p: Plan, rp: RolePlan) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(p, rp.name, rp.labels),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": rp.selector}},
    }


def network_policy(dep: Dsv4Deployment, p: Plan) -> Obj:
    """Servers accept: anything from servers of this deployment (bootstrap, Mooncake transfer and
    collective ports, which Mooncake and HCCL pick at run time; a Mooncake peer can read and write
    registered memory, so nobody else may reach them), and the HTTP port from this deployment's
    routers. When spec.monitoring.scraper is set, that peer reaches the metrics port, and only it
    (a scraper never reaches the generation or transfer ports). Kubelet probes come from the node and
    are not subject to it on common CNIs."""
    servers = {
        "matchLabels": {L_DEPLOYMENT: p.name},
        "matchExpressions": [{"key": L_ROLE, "operator": "In", "values": ["decode", "prefill"]}],
    }
    routers = {"matchLabels": {L_DEPLOYMENT: p.name, L_ROLE: "router"}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(p, p.network_policy, common_labels(p.name)),
        "spec": {
            "podSelector": servers,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": servers}]},
                {
                    "from": [{"podSelector": routers}],
                    "ports": [{"protocol": "TCP", "port": dep.spec.engine.port}],
                },
                *_scraper_rule(dep),
            ],
        },
    }


def _scraper_rule(dep: Dsv4Deployment) -> list[Obj]:
    mon = dep.spec.monitoring
    if mon.scraper is None:
        return []
    peer = mon.scraper.model_dump(by_alias=True, exclude_none=True, mode="json")
    return [{"from": [peer], "ports": [{"protocol": "TCP", "port": mon.metrics_port}]}]


def pod_monitor(dep: Dsv4Deployment, p: Plan) -> Obj:
    """A Prometheus Operator PodMonitor scraping the servers' and the routers' `metrics` ports, every
    generation's (the generation shows in the dsv4_fingerprint label), each series labelled with the
    deployment and the role."""
    spec = dep.spec.monitoring.pod_monitor
    endpoint: Obj = {"port": PORT_METRICS, "path": "/metrics"}
    if spec.interval:
        endpoint["interval"] = spec.interval
    relabel = [
        {"sourceLabels": [f"__meta_kubernetes_pod_label_{_sanitise(k)}"], "targetLabel": target}
        for k, target in ((L_DEPLOYMENT, "dsv4_deployment"), (L_ROLE, "dsv4_role"),
                          (L_FINGERPRINT, "dsv4_fingerprint"))
    ]  # fmt: skip
    endpoint["relabelings"] = relabel
    labels = dict(spec.labels or {}) | common_labels(p.name)  # ours win: pruning lists by them
    return {
        "apiVersion": POD_MONITOR_API,
        "kind": "PodMonitor",
        "metadata": _meta(p, p.name, labels),
        "spec": {
            "selector": {"matchLabels": {L_NAME: APP, L_DEPLOYMENT: p.name}},
            "podMetricsEndpoints": [endpoint],
        },
    }


def _sanitise(label: str) -> str:
    """A pod label's name in Prometheus' Kubernetes discovery meta labels."""
    return "".join(c if c.isalnum() or c == "_" else "_" for c in label)


def render_plan(dep: Dsv4Deployment, p: Plan) -> list[Obj]:
    objs: list[Obj] = [*router_rbac(p), engine_config(dep, p)]
    for rp in (p.prefill, p.decode):
        objs.append(headless_service(p, rp))
    for rp in (p.prefill, p.decode):
        objs.append(worker_statefulset(dep, p, rp, _meta(p, rp.name, rp.labels)))
    objs.append(router_deployment(dep, p, _meta(p, p.router.name, p.router.labels)))
    objs.append(endpoint_service(dep, p))
    objs += [pdb(p, rp) for rp in (p.prefill, p.decode, p.router)]
    if dep.spec.network_policy.enabled:
        objs.append(network_policy(dep, p))
    if dep.spec.monitoring.pod_monitor.enabled:
        objs.append(pod_monitor(dep, p))
    # The plan's label and selector dicts appear in several children; callers adopt and patch each
    # child, so every object must own all of its parts.
    return [copy.deepcopy(o) for o in objs]


def render(
    dep: Dsv4Deployment,
    *,
    serving_fingerprint: str | None = None,
    namespace: str | None = None,
    kube_minor: int | None = None,
) -> list[Obj]:
    """Every child object of `dep`. `serving_fingerprint`: the generation the endpoint Service routes
    to (default: the current one). `namespace`: default metadata.namespace, else "default".
    `kube_minor`: the target Kubernetes 1.x minor version when older than 1.21, whose API has no
    policy/v1 (PodDisruptionBudgets are then policy/v1beta1, same fields)."""
    objs = render_plan(dep, plan(dep, serving_fingerprint=serving_fingerprint, namespace=namespace))
    if kube_minor is not None and kube_minor < 21:
        for obj in objs:
            if obj["kind"] == "PodDisruptionBudget":
                obj["apiVersion"] = "policy/v1beta1"
    return objs


def is_generation_scoped(obj: Obj) -> bool:
    """True for children that belong to one generation (they carry the fingerprint label)."""
    return L_FINGERPRINT in obj.get("metadata", {}).get("labels", {})
