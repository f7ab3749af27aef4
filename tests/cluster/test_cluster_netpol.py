"""The node agent's NetworkPolicy enforcement, without a cluster: Kubernetes' ingress semantics as
`netpol.allowed` computes them (on the operator's own rendered policy, and case by case), and the
nftables table `netpol.ruleset` renders from them (checked by nft itself where it can run)."""

from __future__ import annotations

import copy
import ipaddress
import os
import pathlib
import shutil
import subprocess
from typing import Any

import yaml
from agent.netpol import Allow, allowed, ruleset
from serving import EXAMPLE

from suite import skips

Obj = dict[str, Any]
MONITORING = {"dsv4.test/team": "monitoring"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}


def pod(name: str, ip: str, labels: dict[str, str], ns: str = "default", ports: dict[str, int] | None = None,
        phase: str = "Running") -> Obj:  # fmt: skip
    cports = [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in (ports or {}).items()]
    return {
        "metadata": {"name": name, "namespace": ns, "uid": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "ports": cports}]},
        "status": {"podIP": ip, "phase": phase},
    }


def namespace(name: str, labels: dict[str, str] | None = None) -> Obj:
    return {"metadata": {"name": name, "labels": labels or {}}}


def policy(spec: Obj, ns: str = "default") -> Obj:
    return {"metadata": {"name": "p", "namespace": ns}, "spec": spec}


def admits(rules: list[Allow], src: str, port: int, proto: str = "TCP") -> bool:
    """What the rendered chain does with a new connection from `src` (nft's matching, in Python)."""
    addr = ipaddress.ip_address(src)
    for a in rules:
        if a.sources is not None and not any(addr in ipaddress.ip_network(s) for s in a.sources):
            continue
        if any(addr in ipaddress.ip_network(e) for e in a.excepts):
            continue
        if a.protocol is not None and a.protocol != proto:
            continue
        if a.port is not None and not a.port <= port <= (a.end_port or a.port):
            continue
        return True
    return False


def rendered_pods() -> tuple[list[Obj], list[Obj]]:
    """The CPU example with its NetworkPolicy on and a scraper (Prometheus pods of namespaces labelled
    monitoring), rendered by the operator: its policy, and one pod per role from its templates."""
    from dsv4_operator.manifests import render
    from dsv4_operator.spec import parse

    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["spec"]["networkPolicy"] = {"enabled": True}
    spec["spec"]["monitoring"] = {
        "scraper": {
            "namespaceSelector": {"matchLabels": MONITORING},
            "podSelector": {"matchLabels": PROMETHEUS},
        }
    }
    objs = render(parse(spec), namespace="default")
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    pods = []
    for i, w in enumerate(o for o in objs if o["kind"] in ("StatefulSet", "Deployment")):
        tmpl = copy.deepcopy(w["spec"]["template"])
        role = tmpl["metadata"]["labels"]["dsv4.ai/role"]
        pods.append({"metadata": {**tmpl["metadata"], "name": role, "namespace": "default", "uid": role},
                     "spec": tmpl["spec"], "status": {"podIP": f"10.244.0.{10 + i}", "phase": "Running"}})  # fmt: skip
    return policies, pods


def test_the_operators_policy_admits_the_scraper_to_metrics_and_nothing_else() -> None:
    policies, pods = rendered_pods()
    by_role = {p["metadata"]["name"]: p for p in pods}
    scraper = pod("prometheus", "10.244.0.50", PROMETHEUS, ns="monitoring")
    others = [
        pod("grafana", "10.244.0.51", {"app.kubernetes.io/name": "grafana"}, ns="monitoring"),
        pod("local-prometheus", "10.244.0.52", PROMETHEUS),  # this namespace is not a monitoring one
        pod("elsewhere", "10.244.0.53", PROMETHEUS, ns="team-b"),
    ]
    namespaces = [namespace("default"), namespace("monitoring", MONITORING), namespace("team-b")]
    got = allowed(policies, [*pods, scraper, *others], namespaces)
    ip = lambda role: by_role[role]["status"]["podIP"]  # noqa: E731
    assert set(got) == {ip("prefill"), ip("decode")}  # the router and the strangers stay open
    for role in ("prefill", "decode"):
        ports = {p["name"]: p["containerPort"] for p in by_role[role]["spec"]["containers"][0]["ports"]}
        rules = got[ip(role)]
        assert admits(rules, "10.244.0.50", ports["metrics"])
        for name, port in ports.items():
            if name != "metrics":
                assert not admits(rules, "10.244.0.50", port), (role, name)
            for other in others:
                src = other["status"]["podIP"]
                assert not admits(rules, src, port), (role, name, other["metadata"]["name"])
        assert admits(rules, ip("router"), ports["http"])
        assert not admits(rules, ip("router"), ports["metrics"])
        peer = ip("decode" if role == "prefill" else "prefill")
        assert all(admits(rules, peer, port) for port in (*ports.values(), 12345))  # Mooncake's too


def test_selectors_peers_and_ports_follow_kubernetes() -> None:
    web = {"app": "web"}
    pods = [
        pod("web", "10.244.0.2", web, ports={"http": 8080}),
        pod("web-no-name", "10.244.0.3", web),
        pod("client", "10.244.0.4", {"role": "client"}),
        pod("client-b", "10.244.0.5", {"role": "client"}, ns="b"),
        pod("other-b", "10.244.0.6", {"role": "other"}, ns="b"),
        pod("done", "10.244.0.7", {"role": "client"}, phase="Succeeded"),
    ]
    namespaces = [namespace("default"), namespace("b", {"team": "b"})]
    sel = {"podSelector": {"matchLabels": web}}

    def rules(*ingress: Obj, **spec: Any) -> dict[str, list[Allow]]:
        return allowed([policy({**sel, "ingress": list(ingress), **spec})], pods, namespaces)

    # Selected pods only; an empty ingress list isolates them and admits nobody.
    assert rules() == {"10.244.0.2": [], "10.244.0.3": []}
    # No `from`: anyone, on the listed port; a named port resolves per pod (nothing where unnamed).
    got = rules({"ports": [{"port": "http"}]})
    assert got["10.244.0.2"] == [Allow(None, (), "TCP", 8080)] and got["10.244.0.3"] == []
    # A podSelector alone: this namespace's pods (a finished pod is no peer).
    got = rules({"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]})["10.244.0.2"]
    assert got == [Allow(("10.244.0.4",))]
    # Both selectors in one peer: AND; as two peers: OR.
    both = {
        "namespaceSelector": {"matchLabels": {"team": "b"}},
        "podSelector": {"matchLabels": {"role": "client"}},
    }
    assert rules({"from": [both]})["10.244.0.2"] == [Allow(("10.244.0.5",))]
    split = [{"namespaceSelector": both["namespaceSelector"]}, {"podSelector": both["podSelector"]}]
    assert rules({"from": split})["10.244.0.2"] == [Allow(("10.244.0.4", "10.244.0.5", "10.244.0.6"))]
    # matchExpressions; a peer nobody matches admits nobody.
    expr = {"podSelector": {"matchExpressions": [{"key": "role", "operator": "NotIn", "values": ["client"]}]},
            "namespaceSelector": {}}  # fmt: skip
    assert rules({"from": [expr]})["10.244.0.3"] == [Allow(("10.244.0.2", "10.244.0.3", "10.244.0.6"))]
    assert rules({"from": [{"podSelector": {"matchLabels": {"role": "none"}}}]})["10.244.0.2"] == []
    # ipBlock with except; a port range; UDP.
    block = {"ipBlock": {"cidr": "10.244.0.0/24", "except": ["10.244.0.4/32"]}}
    udp = {"protocol": "UDP", "port": 5000, "endPort": 5010}
    got = rules({"from": [block], "ports": [udp]})["10.244.0.2"]
    assert got == [Allow(("10.244.0.0/24",), ("10.244.0.4/32",), "UDP", 5000, 5010)]
    assert admits(got, "10.244.0.5", 5005, "UDP") and not admits(got, "10.244.0.4", 5005, "UDP")
    assert not admits(got, "10.244.0.5", 5005, "TCP")
    # An Egress-only policy isolates nobody's ingress; another namespace's policy, not these pods.
    assert rules(policyTypes=["Egress"]) == {}
    assert allowed([policy({**sel, "ingress": []}, ns="b")], pods, namespaces) == {}
    # Two policies selecting one pod: the union.
    two = [
        policy({**sel, "ingress": [{"ports": [{"port": 1}]}]}),
        policy({**sel, "ingress": [{"ports": [{"port": 2}]}]}),
    ]
    assert [a.port for a in allowed(two, pods, namespaces)["10.244.0.3"]] == [1, 2]


def test_the_ruleset_is_one_table_nft_accepts(tmp_path: pathlib.Path) -> None:
    allow = {
        "10.244.0.2": [Allow(("10.244.0.3", "10.244.0.4"), (), "TCP", 30000), Allow(None)],
        "10.244.0.5": [
            Allow(("10.244.0.0/24",), ("10.244.0.9/32",), "UDP", 5000, 5010),
            Allow(None, (), "SCTP"),
        ],
        "10.244.0.6": [],
    }
    text = ruleset(allow)
    assert "ct state established,related accept" in text
    assert "ip saddr { 10.244.0.3, 10.244.0.4 } tcp dport 30000 accept" in text
    assert "ip saddr { 10.244.0.0/24 } ip saddr != { 10.244.0.9/32 } udp dport 5000-5010 accept" in text
    assert "meta l4proto sctp accept" in text
    assert text.count("reject with tcp reset") == 3 and "ip daddr 10.244.0.6 jump pod_10_244_0_6" in text
    if os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("unshare"):
        skips.missing("nft's own check needs root, nft and unshare (scripts/setup.sh installs nftables)")
    # Loaded by the kernel in a throwaway network namespace, twice: the second replaces the first.
    (tmp_path / "rules.nft").write_text(text)
    script = 'nft -f "$1" && nft -f "$1" && nft list table inet dsv4_netpol'
    check = subprocess.run(["unshare", "--net", "sh", "-c", script, "-", str(tmp_path / "rules.nft")],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    assert check.returncode == 0, check.stderr
    assert check.stdout.count("reject with tcp reset") == 3  # one table, not two
