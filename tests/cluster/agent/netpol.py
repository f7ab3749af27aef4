"""NetworkPolicy enforcement on this node, as a CNI's policy agent does it: nftables in the node
namespace (a test harness, not a product).

Ingress only: it is all the operator renders (an `Egress` policy type is ignored and logged). Pod to
pod traffic crosses br0, a bridge; with `bridge-nf-call-iptables` on, bridged IPv4 also passes the
inet family's forward hook, where conntrack works (this kernel's bridge family has neither
conntrack nor reject). So one `inet` table: established and related traffic passes, a packet to a
pod that some ingress policy selects jumps to that pod's chain, which accepts what a policy allows
and refuses the rest, TCP with a reset (a refused probe fails at once, where a drop would leave it
to a timeout; real CNIs drop), anything else dropped. Pods no policy selects stay open. Traffic
from the node itself (probes, the tests' threads in the node namespace) does not cross the forward
hook: as on common CNIs, the node reaches its pods whatever the policies say.

`allowed` (pure: objects in, allow-lists out) is Kubernetes' semantics; `ruleset` renders it;
`Enforcer` lists the objects, applies the whole table atomically with one `nft -f` when the result
changes, and records each applied generation in a JSON file the tests synchronise on.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

Obj = dict[str, Any]
TABLE = "dsv4_netpol"
log = logging.getLogger("agent.netpol")


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """meta/v1 LabelSelector semantics: every matchLabels pair and matchExpressions requirement
    holds (`{}` selects everything)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for req in selector.get("matchExpressions") or []:
        op, key, values = req["operator"], req["key"], req.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True


@dataclass(frozen=True, order=True)
class Allow:
    """One accept rule of a policy-selected pod. `sources`: pod addresses or CIDRs (None: from
    anywhere), minus `excepts` (an ipBlock's); `protocol`/`port`/`end_port`: None for all."""

    sources: tuple[str, ...] | None
    excepts: tuple[str, ...] = ()
    protocol: str | None = None
    port: int | None = None
    end_port: int | None = None


def pod_ip(pod: Obj) -> str | None:
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return None  # a finished pod is no peer, and its address could be another's next
    return status.get("podIP")


def _labels(obj: Obj) -> dict[str, str]:
    return obj["metadata"].get("labels") or {}


def _policy_types(spec: Obj) -> list[str]:
    # networking/v1 defaults: Ingress always, Egress when the policy has egress rules.
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if spec.get("egress") else [])]


def _peer_ips(
    peer: Obj, policy_ns: str, pods: list[Obj], ns_labels: Mapping[str, dict[str, str]]
) -> set[str]:
    """The addresses of the pods a podSelector/namespaceSelector peer names: a namespaceSelector
    picks namespaces (absent: the policy's own), a podSelector pods in them (absent: all)."""
    if "namespaceSelector" in peer:
        namespaces = {n for n, labels in ns_labels.items() if selects(peer["namespaceSelector"], labels)}
    else:
        namespaces = {policy_ns}
    pod_sel = peer.get("podSelector") or {}
    return {
        ip
        for p in pods
        if (ip := pod_ip(p)) and p["metadata"]["namespace"] in namespaces and selects(pod_sel, _labels(p))
    }


def _ports(rule: Obj, pod: Obj) -> list[tuple[str | None, int | None, int | None]]:
    """(protocol, port, end_port) the rule opens on `pod`; a named port resolves against the pod's
    container ports (of that protocol), and opens nothing on a pod that has no port of that name."""
    if not rule.get("ports"):
        return [(None, None, None)]  # absent or empty: every port and protocol
    named = {
        (cp["name"], cp.get("protocol", "TCP")): cp["containerPort"]
        for c in pod["spec"].get("containers", [])
        for cp in c.get("ports") or []
        if cp.get("name")
    }
    out = []
    for entry in rule["ports"]:
        proto, port = entry.get("protocol", "TCP"), entry.get("port")
        if isinstance(port, str):
            if (port, proto) not in named:
                continue
            port = named[(port, proto)]
        out.append((proto, port, entry.get("endPort") if port is not None else None))
    return out


def allowed(policies: list[Obj], pods: list[Obj], namespaces: list[Obj]) -> dict[str, list[Allow]]:
    """For every pod (with an address) that some ingress policy selects, the union of what those
    policies let in, sorted; a selected pod with an empty list admits nothing. Pods absent from
    the result are not isolated."""
    ns_labels = {n["metadata"]["name"]: _labels(n) for n in namespaces}
    out: dict[str, set[Allow]] = {}
    for pol in policies:
        spec, ns = pol["spec"], pol["metadata"]["namespace"]
        if "Ingress" not in _policy_types(spec):
            continue
        sel = spec.get("podSelector") or {}
        targets = {
            ip: p
            for p in pods
            if (ip := pod_ip(p)) and p["metadata"]["namespace"] == ns and selects(sel, _labels(p))
        }
        for ip in targets:
            out.setdefault(ip, set())
        for rule in spec.get("ingress") or []:
            peers = rule.get("from")
            froms: list[tuple[tuple[str, ...] | None, tuple[str, ...]]] = []
            if not peers:
                froms.append((None, ()))  # absent or empty: from anywhere
            else:
                ips: set[str] = set()
                for peer in peers:
                    if "ipBlock" in peer:
                        block = peer["ipBlock"]
                        froms.append(((block["cidr"],), tuple(sorted(block.get("except") or []))))
                    else:
                        ips |= _peer_ips(peer, ns, pods, ns_labels)
                if ips:  # no pod matches yet: this peer admits nobody
                    froms.append((tuple(sorted(ips, key=ipaddress.ip_address)), ()))
            for ip, target in targets.items():
                for proto, port, end in _ports(rule, target):
                    for sources, excepts in froms:
                        out[ip].add(Allow(sources, excepts, proto, port, end))
    order = sorted(out, key=ipaddress.ip_address)
    return {ip: sorted(out[ip], key=_sort_key) for ip in order}


def _sort_key(a: Allow) -> tuple[Any, ...]:
    return (a.sources or (), a.excepts, a.protocol or "", a.port or 0, a.end_port or 0)


def _nft_set(items: Iterable[str]) -> str:
    return "{ " + ", ".join(items) + " }"


def _accept(a: Allow) -> str:
    parts = []
    if a.sources is not None:
        parts.append(f"ip saddr {_nft_set(a.sources)}")
    if a.excepts:
        parts.append(f"ip saddr != {_nft_set(a.excepts)}")
    if a.protocol is not None:
        proto = a.protocol.lower()
        if a.port is None:
            parts.append(f"meta l4proto {proto}")
        else:
            ports = f"{a.port}-{a.end_port}" if a.end_port else str(a.port)
            parts.append(f"{proto} dport {ports}")
    return " ".join([*parts, "accept"])


def _chain(ip: str) -> str:
    return "pod_" + ip.replace(".", "_")


def ruleset(allow: Mapping[str, list[Allow]]) -> str:
    """The whole table, for `nft -f`: declared, deleted and declared again in one transaction, so
    the old rules give way to the new ones atomically (and a first run finds a table to delete)."""
    lines = [
        f"table inet {TABLE} {{}}",
        f"delete table inet {TABLE}",
        f"table inet {TABLE} {{",
        "  chain forward {",
        "    type filter hook forward priority filter; policy accept;",
        "    ct state established,related accept",
        *(f"    ip daddr {ip} jump {_chain(ip)}" for ip in allow),
        "  }",
    ]
    for ip, rules in allow.items():
        lines += [
            f"  chain {_chain(ip)} {{",
            *(f"    {_accept(a)}" for a in rules),
            "    meta l4proto tcp reject with tcp reset",
            "    drop",
            "  }",
        ]
    return "\n".join([*lines, "}", ""])


class Enforcer:
    """Keeps the node namespace's table equal to what the API's NetworkPolicies, Pods and
    Namespaces say; `sync` runs on every pass of the agent's loop (a small cluster, listed whole,
    as the agent lists its pods)."""

    def __init__(self, api: Any, netns: str, state: Path) -> None:
        self.api, self.netns, self.state = api, netns, state
        self.generation = 0
        self._applied: str | None = None
        self._ignored: set[str] = set()
        # Bridged IPv4 through the inet hooks: the kernel's default, set here so it is not assumed.
        # Without br_netfilter (not built in, and scripts/test.sh could not load it) nothing can be
        # enforced: the record says why and the tests that need enforcement skip with it.
        self.disabled: str | None = None
        try:
            self._run(["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"])
        except RuntimeError as exc:
            self.disabled = f"no br_netfilter ({exc})"
            log.warning("network policies are not enforced: %s", self.disabled)
        self._record({})

    def _run(self, cmd: list[str], stdin: str | None = None) -> None:
        proc = subprocess.run(
            ["ip", "netns", "exec", self.netns, *cmd], input=stdin, capture_output=True, text=True, timeout=30
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")

    def sync(self, pods: list[Obj], local_ips: Mapping[str, str]) -> None:
        """`local_ips`: uid -> address of the sandboxes this node made: a pod is covered from its
        sandbox's creation, not from when its status reports the address."""
        policies = self.api.get("/apis/networking.k8s.io/v1/networkpolicies")["items"]
        namespaces = self.api.get("/api/v1/namespaces")["items"]
        for pol in policies:
            name = f"{pol['metadata']['namespace']}/{pol['metadata']['name']}"
            if "Egress" in _policy_types(pol["spec"]) and name not in self._ignored:
                self._ignored.add(name)
                log.warning("%s: egress rules are not enforced by this agent", name)
        with_ips = []
        for p in pods:
            ip = pod_ip(p) or local_ips.get(p["metadata"]["uid"])
            if ip:
                with_ips.append({**p, "status": {**(p.get("status") or {}), "podIP": ip}})
        allow = allowed(policies, with_ips, namespaces)
        text = ruleset(allow)
        if text == self._applied or self.disabled:
            return
        self._run(["nft", "-f", "-"], text)
        self._applied = text
        self.generation += 1
        self._record(allow)
        log.info("network policy generation %d: %d pods isolated", self.generation, len(allow))

    def _record(self, allow: Mapping[str, list[Allow]]) -> None:
        record = {
            "generation": self.generation,
            "isolated": {ip: [asdict(a) for a in r] for ip, r in allow.items()},
            "disabled": self.disabled,
        }
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, self.state)  # readers see one generation or the next, never half of one
