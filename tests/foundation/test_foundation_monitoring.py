"""spec.monitoring on the rendered objects: every server has a /metrics-only port named `metrics`; the
NetworkPolicy admits the configured scraper to it and to nothing else, and still refuses everyone
else; a PodMonitor for the servers and the router exists only when asked for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from dsv4_operator import apply
from dsv4_operator.manifests import render
from dsv4_operator.plan import L_DEPLOYMENT, L_FINGERPRINT, L_ROLE, POD_MONITOR_API, PORT_METRICS
from dsv4_operator.spec import SpecError, parse

Make = Callable[..., dict[str, Any]]
NS = "default"
MONITORING_NS = {"kubernetes.io/metadata.name": "monitoring"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
SCRAPER = {
    "namespaceSelector": {"matchLabels": MONITORING_NS},
    "podSelector": {"matchExpressions": [{"key": "app.kubernetes.io/name", "operator": "In",
                                          "values": ["prometheus"]}]},
}  # fmt: skip


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """meta/v1 LabelSelector semantics."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        value, op = labels.get(e["key"]), e["operator"]
        if (op == "In" and value not in e["values"]) or (op == "NotIn" and value in e["values"]):
            return False
        if (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


@dataclass(frozen=True)
class Source:
    labels: dict[str, str]
    namespace: str = NS
    namespace_labels: dict[str, str] = field(default_factory=dict)


def peer_admits(peer: dict[str, Any], src: Source) -> bool:
    """networking/v1 NetworkPolicyPeer: a podSelector alone means this namespace's pods."""
    if "namespaceSelector" in peer:
        ns_labels = {"kubernetes.io/metadata.name": src.namespace, **src.namespace_labels}
        if not matches(peer["namespaceSelector"], ns_labels):
            return False
    elif src.namespace != NS:
        return False
    return matches(peer.get("podSelector", {}), src.labels)


def admitted(policy: dict[str, Any], dest: dict[str, str], port: int, src: Source) -> bool:
    spec = policy["spec"]
    if not matches(spec["podSelector"], dest):
        return True  # the policy does not select this pod
    for rule in spec.get("ingress", []):
        ports = rule.get("ports")
        if ports is not None and not any(p["port"] == port for p in ports):
            continue
        if "from" not in rule or any(peer_admits(peer, src) for peer in rule["from"]):
            return True
    return False


def pod_labels(objs: list[dict[str, Any]], role: str) -> dict[str, str]:
    (w,) = [
        o
        for o in objs
        if o["kind"] in ("StatefulSet", "Deployment") and o["metadata"]["labels"][L_ROLE] == role
    ]
    return w["spec"]["template"]["metadata"]["labels"]


def container_ports(objs: list[dict[str, Any]], role: str) -> dict[str, int]:
    (w,) = [
        o
        for o in objs
        if o["kind"] in ("StatefulSet", "Deployment") and o["metadata"]["labels"][L_ROLE] == role
    ]
    return {p["name"]: p["containerPort"] for p in w["spec"]["template"]["spec"]["containers"][0]["ports"]}


def the(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def test_every_server_has_a_metrics_port_and_serves_it(with_spec: Make) -> None:
    objs = render(parse(with_spec(monitoring={"metricsPort": 29500})))
    for role in ("prefill", "decode"):
        assert container_ports(objs, role)[PORT_METRICS] == 29500
        (sts,) = [o for o in the(objs, "StatefulSet") if o["metadata"]["labels"][L_ROLE] == role]
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--metrics-port") + 1] == "29500"
        assert args[args.index("--port") + 1] == "30000"  # the API stays where it was
    assert container_ports(objs, "router")[PORT_METRICS] == 29000  # sglang-router's --prometheus-port


def test_the_scraper_reaches_the_metrics_port_and_nothing_else(with_spec: Make) -> None:
    objs = render(parse(with_spec(monitoring={"scraper": SCRAPER})))
    (policy,) = the(objs, "NetworkPolicy")
    prometheus = Source(PROMETHEUS, namespace="monitoring")
    others = {
        "another pod in the monitoring namespace": Source(
            {"app.kubernetes.io/name": "grafana"}, "monitoring"
        ),
        "a prometheus in another namespace": Source(PROMETHEUS, namespace="team-b"),
        "a prometheus-labelled pod in this namespace": Source(PROMETHEUS),
        "a pod of another deployment": Source({L_DEPLOYMENT: "other", L_ROLE: "router"}),
    }
    router = Source(pod_labels(objs, "router"))
    for role in ("prefill", "decode"):
        dest, ports = pod_labels(objs, role), container_ports(objs, role)
        assert admitted(policy, dest, ports["metrics"], prometheus)
        for name in ("http", "bootstrap"):
            if name in ports:
                assert not admitted(policy, dest, ports[name], prometheus), (role, name)
        for why, src in others.items():
            for port in ports.values():
                assert not admitted(policy, dest, port, src), (role, why, port)
        assert admitted(policy, dest, ports["http"], router)
        assert not admitted(policy, dest, ports["metrics"], router)  # the router has no need of it
    assert not admitted(policy, pod_labels(objs, "decode"), 12345, prometheus)  # a transfer port


def test_without_a_scraper_nobody_outside_reaches_the_servers(minimal: dict[str, Any]) -> None:
    objs = render(parse(minimal))
    (policy,) = the(objs, "NetworkPolicy")
    prometheus = Source(PROMETHEUS, namespace="monitoring", namespace_labels=MONITORING_NS)
    for role in ("prefill", "decode"):
        for port in container_ports(objs, role).values():
            assert not admitted(policy, pod_labels(objs, role), port, prometheus)
    # The deployment's own servers still reach each other everywhere (bootstrap, Mooncake, metrics).
    peer = Source(pod_labels(objs, "decode"))
    assert admitted(policy, pod_labels(objs, "prefill"), 29100, peer)


def test_a_pod_selector_alone_means_this_namespace(with_spec: Make) -> None:
    objs = render(parse(with_spec(monitoring={"scraper": {"podSelector": {"matchLabels": PROMETHEUS}}})))
    (policy,) = the(objs, "NetworkPolicy")
    dest = pod_labels(objs, "decode")
    assert admitted(policy, dest, 29100, Source(PROMETHEUS))
    assert not admitted(policy, dest, 29100, Source(PROMETHEUS, namespace="monitoring"))
    assert not admitted(policy, dest, 30000, Source(PROMETHEUS))


def test_pod_monitor_only_when_asked(with_spec: Make, minimal: dict[str, Any]) -> None:
    assert not the(render(parse(minimal)), "PodMonitor")
    assert not the(render(parse(with_spec(monitoring={"podMonitor": {"enabled": False}}))), "PodMonitor")
    mon = {"enabled": True, "labels": {"release": "kps", L_DEPLOYMENT: "not-mine"}, "interval": "15s"}
    objs = render(parse(with_spec(monitoring={"podMonitor": mon})))
    (pm,) = the(objs, "PodMonitor")
    assert pm["apiVersion"] == POD_MONITOR_API
    assert pm["metadata"]["labels"]["release"] == "kps"
    assert pm["metadata"]["labels"][L_DEPLOYMENT] == "dsv4"  # ours win: pruning finds it by this label
    assert L_FINGERPRINT not in pm["metadata"]["labels"]  # shared: it outlives generations
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == PORT_METRICS and endpoint["interval"] == "15s"
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert targets["dsv4_deployment"] == ["__meta_kubernetes_pod_label_dsv4_ai_deployment"]
    assert targets["dsv4_role"] == ["__meta_kubernetes_pod_label_dsv4_ai_role"]
    for role in ("prefill", "decode", "router"):  # one PodMonitor scrapes all three roles
        assert matches(pm["spec"]["selector"], pod_labels(objs, role)), role
        assert PORT_METRICS in container_ports(objs, role)
    other = render(parse(with_spec(monitoring={"podMonitor": mon}) | {"metadata": {"name": "other"}}))
    assert not matches(pm["spec"]["selector"], pod_labels(other, "decode"))
    assert "interval" not in the(render(parse(with_spec(monitoring={"podMonitor": {"enabled": True}}))),
                                 "PodMonitor")[0]["spec"]["podMetricsEndpoints"][0]  # fmt: skip


def test_the_operator_lists_pod_monitors_to_prune_them() -> None:
    assert ("monitoring.coreos.com/v1", "PodMonitor") in apply.CHILD_KINDS


@pytest.mark.parametrize(
    ("monitoring", "field"),
    [
        ({"metricsPort": 30000}, "spec.monitoring.metricsPort"),
        ({"metricsPort": 8998}, "spec.monitoring.metricsPort"),
        ({"scraper": {}}, "spec.monitoring.scraper"),
        ({"scraper": {"podSelector": {"matchExpressions": [{"key": "a", "operator": "Exists",
                                                            "values": ["x"]}]}}},
         "spec.monitoring.scraper.podSelector.matchExpressions[0].values"),
        ({"podMonitor": {"interval": "15 seconds"}}, "spec.monitoring.podMonitor.interval"),
    ],
)  # fmt: skip
def test_bad_monitoring_specs_name_their_field(with_spec: Make, monitoring: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse(with_spec(monitoring=monitoring))
    assert [p for p, _ in err.value.errors] == [field]
