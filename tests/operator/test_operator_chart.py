"""The Helm chart: its CRD is the repo's CRD, its values obey its schema, `helm lint --strict` and
`helm template` pass with a real helm for several values files, every rendered manifest is a valid
Kubernetes object, names follow the `helm create` conventions and never collide between releases,
the names the chart renders are the ones the operator is told, and its RBAC grants what the operator
does and no more. The `helm test` Pod's check runs here against stand-in servers."""

from __future__ import annotations

import argparse
import contextlib
import http.server
import itertools
import json
import os
import pathlib
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import jsonschema
import kubernetes_validate
import pytest
import yaml

from dsv4_operator import apply, run, webhook
from dsv4_operator.config import Config
from dsv4_operator.kube import plural
from suite import tools

ROOT = pathlib.Path(__file__).parents[2]
CHART = ROOT / "charts" / "dsv4-operator"
VERBS = {"get", "list", "watch", "create", "patch", "delete"}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "ValidatingWebhookConfiguration"}
K8S_VERSIONS = ("1.25.0", "1.37.0")  # the oldest and newest kubernetes-validate bundles
NS = "dsv4-system"

# Values files `helm template` and `helm lint` run with: the defaults, and every value the chart has.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "fullnameOverride": {"fullnameOverride": "ops"},
    "nameOverride": {"nameOverride": "inference-operator"},
    "existing-serviceaccount": {"serviceAccount": {"create": False, "name": "platform-operator"}},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
    "single-replica-no-webhook": {"replicaCount": 1, "leaderElection": {"enabled": False}, "webhook": {"enabled": False}},
    "servicemonitor-bool": {"metrics": {"serviceMonitor": True}},
    "everything": {
        "image": {"repository": "registry.example.com/dsv4/operator", "tag": "0.1.0-rc1", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "replicaCount": 3,
        "leaderElection": {"enabled": True, "leaseSeconds": 30, "leaseName": "dsv4-leader"},
        "watchNamespaces": ["team-a"],
        "resyncSeconds": 120,
        "webhook": {"enabled": True, "port": 10443, "secretName": "dsv4-tls", "configurationName": "admission.example.com"},
        "metrics": {"port": 9191, "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}, "interval": "30s", "scrapeTimeout": "10s"}},
        "monitoring": {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
                       "grafanaDashboard": {"enabled": True, "labels": {"team": "llm"}, "annotations": {"grafana_folder": "LLM"}}},
        "liveness": {"port": 8181},
        "serviceAccount": {"create": True, "name": "dsv4-ctl", "annotations": {"iam.example.com/role": "dsv4"}},
        "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}, "runAsUser": 1000},
        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "podLabels": {"team": "platform", "app.kubernetes.io/name": "cannot-replace-the-selector"},
        "podAnnotations": {"example.com/owner": "platform"},
        "priorityClassName": "system-cluster-critical",
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]}]}]}}},
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"},
            {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
             "labelSelector": {"matchLabels": {"team": "platform"}}},
        ],
        "extraArgs": ["--verbose"],
        "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy.example.com:3128"},
                     {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def helm() -> str:
    return tools.helm()


def template(helm: str, *args: str, release: str = "rel", namespace: str = NS) -> list[dict]:
    out = subprocess.run(
        [helm, "template", release, str(CHART), "-n", namespace, "--api-versions", "policy/v1/PodDisruptionBudget", *args],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


def values_file(tmp_path: pathlib.Path, values: dict[str, Any], name: str = "values") -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def render(helm: str, tmp_path: pathlib.Path, values: dict[str, Any], **kw: str) -> list[dict]:
    return template(helm, "-f", values_file(tmp_path, values), **kw)


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in objs if o["kind"] == kind])
    return found[0]


def pod_spec(objs: list[dict]) -> dict:
    return one(objs, "Deployment")["spec"]["template"]["spec"]


def operator_args(objs: list[dict]) -> argparse.Namespace:
    """What `dsv4 operator` makes of the Deployment's args (as the kubelet expands them)."""
    namespace = one(objs, "Deployment")["metadata"]["namespace"]
    args = [a.replace("$(POD_NAMESPACE)", namespace).replace("$(POD_NAME)", "pod-0")
            for a in pod_spec(objs)["containers"][0]["args"]]  # fmt: skip
    return run.parse_args(args)


def operator_config(objs: list[dict]) -> Config:
    return run.config(operator_args(objs))


def resource_names(rules: list[dict], group: str, resource: str) -> set[str]:
    return {
        n for r in rules if group in r["apiGroups"] and resource in r["resources"]
        for n in r.get("resourceNames", [])
    }  # fmt: skip


# -- The CRD and the values schema -------------------------------------------------------------


def test_chart_crd_is_the_repo_crd() -> None:
    assert (CHART / "crds" / "dsv4deployment.yaml").read_bytes() == (
        ROOT / "crds" / "dsv4deployment.yaml"
    ).read_bytes()


def test_values_obey_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {**yaml.safe_load((CHART / "values.yaml").read_text()), "replicaCount": 0}, schema
        )


def test_every_value_is_documented_and_in_the_schema() -> None:
    """Every key of values.yaml has a comment line right above it and an entry in the schema (Kubernetes
    objects passed through, such as securityContext, are documented as a whole)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    commented = {
        (len(line) - len(line.lstrip()), line.strip().split(":", 1)[0])
        for prev, line in itertools.pairwise(lines)
        if prev.lstrip().startswith("#") and ":" in line and not line.lstrip().startswith("#")
    }
    passthrough = {"podSecurityContext", "securityContext", "resources"}

    def resolve(sub: dict) -> dict:
        if "$ref" in sub:
            sub = schema["definitions"][sub["$ref"].rsplit("/", 1)[-1]]
        return next((b for b in sub.get("oneOf", []) if b.get("type") == "object"), sub)

    def walk(node: dict, sch: dict, depth: int, path: str) -> None:
        for key, val in node.items():
            sub = sch.get("properties", {}).get(key)
            assert sub is not None, f"{path}{key} is not in values.schema.json"
            sub = resolve(sub)
            assert "type" in sub or "enum" in sub, f"{path}{key}: no type in the schema"
            assert (depth * 2, key) in commented, f"{path}{key} has no comment in values.yaml"
            if isinstance(val, dict) and key not in passthrough and "properties" in sub:
                walk(val, sub, depth + 1, f"{path}{key}.")

    walk(yaml.safe_load((CHART / "values.yaml").read_text()), schema, 0, "")


def test_helm_lint_strict(helm: str, tmp_path: pathlib.Path) -> None:
    for name, values in VALUE_SETS.items():
        proc = subprocess.run(
            [helm, "lint", "--strict", str(CHART), "-f", values_file(tmp_path, values, name)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, (name, proc.stdout + proc.stderr)


def test_helm_rejects_values_outside_the_schema(helm: str) -> None:
    proc = subprocess.run(
        [helm, "template", "rel", str(CHART), "--set", "replicaCount=0"], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "replicaCount" in proc.stderr


BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "nameOverride-type": ({"nameOverride": 3}, "nameOverride"),
    "fullnameOverride-not-a-dns-label": ({"fullnameOverride": "Ops_Team"}, "fullnameOverride"),
    "serviceAccount.create-type": ({"serviceAccount": {"create": "yes"}}, "serviceAccount"),
    "serviceAccount.unknown-key": ({"serviceAccount": {"automount": True}}, "serviceAccount"),
    "serviceAccount.annotations-values": ({"serviceAccount": {"annotations": {"a": 1}}}, "serviceAccount"),
    "podSecurityContext-type": ({"podSecurityContext": []}, "podSecurityContext"),
    "podSecurityContext.runAsUser-type": ({"podSecurityContext": {"runAsUser": "root"}}, "podSecurityContext"),
    "securityContext.capabilities-shape": ({"securityContext": {"capabilities": {"drop": "ALL"}}}, "securityContext"),
    "podLabels-values": ({"podLabels": {"team": 7}}, "podLabels"),
    "priorityClassName-type": ({"priorityClassName": True}, "priorityClassName"),
    "topologySpreadConstraints-type": ({"topologySpreadConstraints": {"maxSkew": 1}}, "topologySpreadConstraints"),
    "topologySpreadConstraints-required": ({"topologySpreadConstraints": [{"maxSkew": 1}]}, "topologySpreadConstraints"),
    "extraArgs-type": ({"extraArgs": "--verbose"}, "extraArgs"),
    "extraArgs-not-a-flag": ({"extraArgs": ["verbose"]}, "extraArgs"),
    "extraEnv-shape": ({"extraEnv": [{"value": "no name"}]}, "extraEnv"),
    "extraEnv-map": ({"extraEnv": {"A": "b"}}, "extraEnv"),
    "serviceMonitor-type": ({"metrics": {"serviceMonitor": "yes"}}, "serviceMonitor"),
    "serviceMonitor.interval-format": ({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}}, "serviceMonitor"),
    "serviceMonitor.labels-values": ({"metrics": {"serviceMonitor": {"labels": {"release": 1}}}}, "serviceMonitor"),
    "webhook.configurationName-one-label": ({"webhook": {"configurationName": "validate"}}, "configurationName"),
    "leaderElection.leaseName-type": ({"leaderElection": {"leaseName": 5}}, "leaseName"),
    "imagePullSecrets-strings": ({"imagePullSecrets": ["regcred"]}, "imagePullSecrets"),
    "resources-unknown-key": ({"resources": {"request": {"cpu": "1"}}}, "resources"),
    "tolerations-operator": ({"tolerations": [{"key": "a", "operator": "Is"}]}, "tolerations"),
    "unknown-top-level": ({"replicas": 2}, "replicas"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_VALUES, ids=str)
def test_schema_rejects_wrong_types(helm: str, tmp_path: pathlib.Path, case: str) -> None:
    values, key = BAD_VALUES[case]
    proc = subprocess.run(
        [helm, "template", "rel", str(CHART), "-f", values_file(tmp_path, values)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and "schema" in proc.stderr and key in proc.stderr, proc.stderr


# -- Every values file renders valid objects, named by the release ---------------------------


@pytest.mark.parametrize("name", VALUE_SETS, ids=str)
def test_rendered_manifests_are_valid_and_named_by_the_release(
    helm: str, tmp_path: pathlib.Path, name: str
) -> None:
    values = VALUE_SETS[name]
    objs = render(helm, tmp_path, values)
    full = values.get("fullnameOverride") or f"rel-{values.get('nameOverride') or 'dsv4-operator'}"
    given = {values.get("serviceAccount", {}).get("name")}  # a name set by value, not derived
    watched = set(values.get("watchNamespaces", []))
    for obj in objs:
        meta, kind = obj["metadata"], obj["kind"]
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            # not built-in kinds: checked in test_service_monitor and test_prometheus_rule_and_dashboard
            assert kind in ("ServiceMonitor", "PrometheusRule")
        else:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
        assert meta["labels"]["app.kubernetes.io/instance"] == "rel"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert meta["labels"]["app.kubernetes.io/name"] == values.get("nameOverride", "dsv4-operator")
        if kind == "ValidatingWebhookConfiguration":
            assert "webhooks" not in obj  # the operator writes them; helm must never overwrite them
        elif kind in CLUSTER_SCOPED or meta.get("namespace") in watched - {NS}:
            assert "namespace" not in meta or kind in ("Role", "RoleBinding")
            assert meta["name"].startswith(f"{full}-{NS}"), (kind, meta["name"])
        else:
            assert meta["namespace"] == NS, (kind, meta["name"])
            assert meta["name"].startswith(full) or meta["name"] in given, (kind, meta["name"])


def test_default_names_are_todays_for_a_release_named_like_the_chart(helm: str) -> None:
    """`helm install dsv4-operator ...` keeps chart 0.1.0's names inside the namespace."""
    objs = template(helm, release="dsv4-operator")
    cfg = operator_config(objs)
    assert one(objs, "Deployment")["metadata"]["name"] == "dsv4-operator"
    assert one(objs, "ServiceAccount")["metadata"]["name"] == "dsv4-operator"
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "Service"} == {
        "dsv4-operator-webhook",
        "dsv4-operator-metrics",
    }
    assert (cfg.webhook_service, cfg.webhook_secret, cfg.lease_name) == (
        "dsv4-operator-webhook",
        "dsv4-operator-webhook-tls",
        "dsv4-operator",
    )
    # Cluster-scoped: per release now (chart 0.1.0 had dsv4-operator-cluster and validate.dsv4.ai).
    assert one(objs, "ClusterRole", "dsv4-operator-dsv4-system-cluster")
    assert cfg.webhook_config == "dsv4-operator.dsv4-system.validate.dsv4.ai"


def test_fullname_rules_follow_the_helm_create_scaffold(helm: str) -> None:
    def deployment_name(release: str, *args: str) -> str:
        return one(template(helm, *args, release=release), "Deployment")["metadata"]["name"]

    assert deployment_name("rel") == "rel-dsv4-operator"
    assert deployment_name("prod-dsv4-operator") == "prod-dsv4-operator"  # contains the chart name
    assert deployment_name("rel", "--set", "nameOverride=infer") == "rel-infer"
    assert deployment_name("rel", "--set", "fullnameOverride=ops") == "ops"
    long = "r" * 53  # helm's longest release name
    assert deployment_name(long) == f"{long}-dsv4-operator"[:63]
    services = {o["metadata"]["name"] for o in template(helm, release=long) if o["kind"] == "Service"}
    assert len(services) == 2 and all(len(s) <= 63 for s in services)  # distinct even when cut


@pytest.mark.parametrize("name", ["defaults", "fullnameOverride", "everything", "existing-serviceaccount"])
def test_the_names_the_chart_renders_are_the_ones_the_operator_is_told(
    helm: str, tmp_path: pathlib.Path, name: str
) -> None:
    """The webhook configuration, its Service and Secret, and the Lease: RBAC, objects and flags agree."""
    objs = render(helm, tmp_path, VALUE_SETS[name])
    cfg = operator_config(objs)
    cluster = next(
        o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("-cluster")
    )
    self_role = next(o for o in objs if o["kind"] == "Role" and o["metadata"]["name"].endswith("-self"))
    assert cfg.namespace == NS and cfg.webhook and cfg.leader_elect
    assert resource_names(
        cluster["rules"], "admissionregistration.k8s.io", "validatingwebhookconfigurations"
    ) == {cfg.webhook_config}
    assert one(objs, "ValidatingWebhookConfiguration")["metadata"]["name"] == cfg.webhook_config
    assert one(objs, "Service", cfg.webhook_service)["spec"]["ports"][0]["port"] == cfg.webhook_port
    assert resource_names(self_role["rules"], "", "secrets") == {cfg.webhook_secret}
    assert resource_names(self_role["rules"], "coordination.k8s.io", "leases") == {cfg.lease_name}
    if name == "everything":
        assert (cfg.webhook_config, cfg.webhook_secret, cfg.lease_name) == (
            "admission.example.com", "dsv4-tls", "dsv4-leader",
        )  # fmt: skip
        assert (cfg.lease_seconds, cfg.resync_seconds, cfg.metrics_port) == (30, 120, 9191)


def _two_releases(helm: str, release_a: str, release_b: str) -> tuple[list[dict], list[dict]]:
    a = template(helm, "--set", "watchNamespaces={team-a}", release=release_a, namespace="team-a-ops")
    b = template(helm, "--set", "watchNamespaces={team-b}", release=release_b, namespace="team-b-ops")
    return a, b


@pytest.mark.parametrize(
    "releases", [("dsv4-operator", "dsv4-operator"), ("alpha", "beta")], ids=["same-name", "own-names"]
)
def test_two_releases_in_two_namespaces_never_collide(helm: str, releases: tuple[str, str]) -> None:
    a, b = _two_releases(helm, *releases)

    def keys(objs: list[dict]) -> set[tuple[str, str, str]]:
        return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in objs}

    assert not keys(a) & keys(b)
    cfg_a, cfg_b = operator_config(a), operator_config(b)
    assert cfg_a.webhook_config != cfg_b.webhook_config
    for objs, ns, release, watched in (
        (a, "team-a-ops", releases[0], "team-a"),
        (b, "team-b-ops", releases[1], "team-b"),
    ):
        sa = one(objs, "ServiceAccount")["metadata"]["name"]
        for obj in objs:
            assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == release
            assert obj["metadata"].get("namespace") in (None, ns, watched)
            for subject in obj.get("subjects", []):
                assert (subject["name"], subject["namespace"]) == (sa, ns)
            if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
                kind = "ClusterRole" if obj["kind"] == "ClusterRoleBinding" else "Role"
                assert one(objs, kind, obj["roleRef"]["name"])  # binds this release's own role
        assert {o["metadata"]["namespace"] for o in objs if o["kind"] == "Role"} == {ns, watched}
        assert operator_args(objs).watch_namespace == [watched]
        assert operator_config(objs).watch_namespaces == (watched,)  # what its webhook is registered for
        # The claim the next release's install reads (dsv4-operator.refuseOverlap; tests/kube tries it).
        claim = one(objs, "ClusterRole", f"{sa}-{ns}-cluster")["metadata"]["annotations"]
        assert claim == {"dsv4.ai/watch-namespaces": watched}
    cluster_wide = one(template(helm), "ClusterRole", f"rel-dsv4-operator-{NS}-cluster")
    assert cluster_wide["metadata"]["annotations"] == {"dsv4.ai/watch-namespaces": "*"}


# -- Values reach the pod ---------------------------------------------------------------------


def test_defaults_keep_todays_pod(helm: str) -> None:
    spec = pod_spec(template(helm))
    container = spec["containers"][0]
    assert spec["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"},
    }  # fmt: skip
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
    }  # fmt: skip
    assert "priorityClassName" not in spec and "topologySpreadConstraints" not in spec
    assert [e["name"] for e in container["env"]] == ["POD_NAMESPACE", "POD_NAME"]
    assert container["args"][-1] == "--lease-seconds=15"  # nothing appended


def test_every_new_value_reaches_the_pod(helm: str, tmp_path: pathlib.Path) -> None:
    objs = render(helm, tmp_path, VALUE_SETS["everything"])
    dep = one(objs, "Deployment")
    spec, meta = dep["spec"]["template"]["spec"], dep["spec"]["template"]["metadata"]
    container = spec["containers"][0]
    assert meta["labels"]["team"] == "platform"
    assert meta["labels"]["app.kubernetes.io/name"] == "dsv4-operator"  # podLabels cannot break the selector
    assert dep["spec"]["selector"]["matchLabels"].items() <= meta["labels"].items()
    assert meta["annotations"]["example.com/owner"] == "platform"
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["securityContext"]["runAsUser"] == 1000 and spec["securityContext"]["fsGroup"] == 1000
    assert container["securityContext"]["runAsUser"] == 1000
    assert spec["serviceAccountName"] == "dsv4-ctl"
    sa = one(objs, "ServiceAccount", "dsv4-ctl")
    assert sa["metadata"]["annotations"] == {"iam.example.com/role": "dsv4"}
    zone, host = spec["topologySpreadConstraints"]
    assert zone["labelSelector"] == {"matchLabels": dep["spec"]["selector"]["matchLabels"]}  # filled in
    assert host["labelSelector"] == {"matchLabels": {"team": "platform"}}  # kept as given
    assert container["args"][-1] == "--verbose"
    assert run.parse_args(container["args"]).verbose
    assert container["env"][2:] == VALUE_SETS["everything"]["extraEnv"]
    assert container["image"] == "registry.example.com/dsv4/operator:0.1.0-rc1"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert (
        spec["nodeSelector"] == {"kubernetes.io/os": "linux"} and spec["tolerations"][0]["key"] == "dedicated"
    )
    assert "nodeAffinity" in spec["affinity"]
    assert container["resources"]["limits"] == {"memory": "1Gi"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "webhook": 10443,
        "metrics": 9191,
        "healthz": 8181,
    }
    assert dep["spec"]["replicas"] == 3


def test_existing_service_account_is_bound_not_created(helm: str, tmp_path: pathlib.Path) -> None:
    objs = render(helm, tmp_path, VALUE_SETS["existing-serviceaccount"])
    assert not [o for o in objs if o["kind"] == "ServiceAccount"]
    assert pod_spec(objs)["serviceAccountName"] == "platform-operator"
    subjects = [s for o in objs for s in o.get("subjects", [])]
    assert subjects and all((s["name"], s["namespace"]) == ("platform-operator", NS) for s in subjects)
    assert one(objs, "Pod")["spec"]["serviceAccountName"] == "platform-operator"  # helm test too
    unnamed = template(helm, "--set", "serviceAccount.create=false")
    assert pod_spec(unnamed)["serviceAccountName"] == "default"


def test_podsecuritycontext_key_can_be_dropped_with_null(helm: str) -> None:
    spec = pod_spec(template(helm, "--set", "podSecurityContext.runAsUser=null"))
    assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


# -- ServiceMonitor, NOTES, helm test ---------------------------------------------------------


def test_service_monitor(helm: str, tmp_path: pathlib.Path) -> None:
    assert not [o for o in template(helm) if o["kind"] == "ServiceMonitor"]  # off by default
    objs = render(helm, tmp_path, VALUE_SETS["everything"])
    sm = one(objs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kps"  # what kube-prometheus-stack selects by
    assert sm["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"
    assert sm["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}
    ]
    selected = [
        o["metadata"]["name"] for o in objs if o["kind"] == "Service"
        and sm["spec"]["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()
    ]  # fmt: skip
    assert selected == ["rel-dsv4-operator-metrics"]
    port = one(objs, "Service", "rel-dsv4-operator-metrics")["spec"]["ports"][0]
    assert (port["name"], port["port"]) == ("metrics", 9191)


def test_prometheus_rule_and_dashboard(helm: str, tmp_path: pathlib.Path) -> None:
    """Off by default; on, the PrometheusRule is files/alerts.yaml (what promtool tests) and the
    dashboard ConfigMap holds files/dashboard.json, labelled for Grafana's sidecar."""
    assert not [o for o in template(helm) if o["kind"] in ("PrometheusRule", "ConfigMap")]
    objs = render(helm, tmp_path, VALUE_SETS["everything"])
    rule = one(objs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert rule["metadata"]["labels"]["release"] == "kps"
    cm = one(objs, "ConfigMap", "rel-dsv4-operator-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["labels"]["team"] == "llm"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(cm["data"]["dsv4.json"]) == json.loads((CHART / "files" / "dashboard.json").read_text())
    elsewhere = template(helm, "--set", "monitoring.grafanaDashboard.enabled=true",
                         "--set", "monitoring.grafanaDashboard.namespace=grafana")  # fmt: skip
    assert one(elsewhere, "ConfigMap", "rel-dsv4-operator-dashboard")["metadata"]["namespace"] == "grafana"
    assert not [o for o in elsewhere if o["kind"] == "PrometheusRule"]


@pytest.mark.parametrize("flag", ["true", "false"])
def test_service_monitor_boolean_form_still_works(helm: str, flag: str) -> None:
    """Chart 0.1.0's `metrics.serviceMonitor: true|false`."""
    objs = template(helm, "--set", f"metrics.serviceMonitor={flag}")
    monitors = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert len(monitors) == (flag == "true")
    if monitors:
        assert monitors[0]["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics"}]


def notes(helm: str, *args: str) -> str:
    proc = subprocess.run(
        [helm, "install", "rel", str(CHART), "-n", NS, "--dry-run=client", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("NOTES:", 1)[1]


def test_notes_say_what_was_installed_and_how_to_check_it(helm: str) -> None:
    text = notes(helm)
    for expected in (
        "dsv4-system/rel-dsv4-operator",
        "rel-dsv4-operator.dsv4-system.validate.dsv4.ai",
        "every namespace",
        "helm test rel -n dsv4-system",
        "kubectl -n dsv4-system rollout status deployment/rel-dsv4-operator",
        "kubectl apply -n default -f examples/",
        "kubectl get dsv4 -n default",
        "http://rel-dsv4-operator-metrics.dsv4-system.svc:9090/metrics",
    ):
        assert expected in text, expected
    scoped = notes(helm, "--set", "watchNamespaces={team-a,team-b}", "--set", "webhook.enabled=false")
    assert "namespaces team-a, team-b" in scoped and "kubectl get dsv4 -n team-a" in scoped
    assert "validate.dsv4.ai" not in scoped and "off (webhook.enabled=false)" in scoped


def test_helm_test_pod_checks_the_release_with_its_own_account_and_image(helm: str) -> None:
    objs = template(helm, "--set", "metrics.port=9191")
    pod = one(objs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    dep_spec = pod_spec(objs)
    container = pod["spec"]["containers"][0]
    assert container["image"] == dep_spec["containers"][0]["image"]  # no other image is pulled
    assert pod["spec"]["serviceAccountName"] == dep_spec["serviceAccountName"]
    assert pod["spec"]["securityContext"] == dep_spec["securityContext"]
    assert pod["spec"]["restartPolicy"] == "Never"
    env = {e["name"]: e["value"] for e in container["env"]}
    metrics = one(objs, "Service", "rel-dsv4-operator-metrics")
    assert env["METRICS_URL"] == f"http://{metrics['metadata']['name']}.{NS}.svc:9191/metrics"
    assert (
        env["CRD_NAME"]
        == yaml.safe_load((ROOT / "crds" / "dsv4deployment.yaml").read_text())["metadata"]["name"]
    )
    assert container["command"][:2] == ["python", "-c"]
    # The chart's account may read what the check reads.
    cluster = next(
        o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("-cluster")
    )
    assert any(
        "customresourcedefinitions" in r["resources"] and "get" in r["verbs"] for r in cluster["rules"]
    )


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[int, bytes]]] = {}
    token: ClassVar[str] = ""

    def do_GET(self) -> None:
        if self.token and self.headers.get("Authorization") != f"Bearer {self.token}":
            code, body = 401, b'{"kind":"Status","code":401}'
        else:
            code, body = self.routes.get(self.path, (404, b"not found"))
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@contextlib.contextmanager
def _serve(
    routes: dict[str, tuple[int, bytes]], token: str = "", tls: tuple[str, str] | None = None
) -> Iterator[int]:
    handler = type("Handler", (_Handler,), {"routes": routes, "token": token})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(*tls)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/dsv4deployments.dsv4.ai"
METRICS = b"# HELP dsv4_operator_reconcile_total Reconciles of Dsv4Deployments by result.\n"


@pytest.mark.parametrize(
    ("case", "metrics", "established", "token", "ok"),
    [
        ("healthy", METRICS, "True", "sa-token", True),
        ("not-the-operator", b"# HELP go_goroutines\n", "True", "sa-token", False),
        ("crd-not-established", METRICS, "False", "sa-token", False),
        ("account-refused", METRICS, "True", "another-token", False),
    ],
    ids=["healthy", "not-the-operator", "crd-not-established", "account-refused"],
)
def test_helm_test_script_fails_unless_metrics_answer_and_the_crd_is_established(
    helm: str, tmp_path: pathlib.Path, case: str, metrics: bytes, established: str, token: str, ok: bool
) -> None:
    """The helm test Pod's own script, run against a stand-in metrics Service and a TLS API server."""
    pod = one(template(helm), "Pod")
    container = pod["spec"]["containers"][0]
    script = container["command"][2]
    cert, key = webhook.make_certificate(["127.0.0.1"])
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "ca.crt").write_bytes(cert)
    (sa / "token").write_text(token + "\n")
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    crd = {
        "status": {
            "conditions": [
                {"type": "NamesAccepted", "status": "True"},
                {"type": "Established", "status": established},
            ]
        }
    }
    with (
        _serve({"/metrics": (200, metrics)}) as metrics_port,
        _serve({CRD_PATH: (200, json.dumps(crd).encode())}, "sa-token", (str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))) as api_port,
    ):  # fmt: skip
        env = {e["name"]: e["value"] for e in container["env"]}
        env["METRICS_URL"] = f"http://127.0.0.1:{metrics_port}/metrics"
        env |= {
            "SA_DIR": str(sa),
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(api_port),
        }
        proc = subprocess.run(
            [sys.executable, "-c", script], env={**env, "PATH": os.environ["PATH"]},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert (proc.returncode == 0) == ok, (case, proc.stdout, proc.stderr)
    if ok:
        assert "is Established" in proc.stdout and "serves dsv4_operator_* metrics" in proc.stdout


# -- RBAC --------------------------------------------------------------------------------------


def _rules(objs: list[dict], kind: str, name: str) -> list[dict]:
    return one(objs, kind, name)["rules"]


def test_rbac_grants_what_the_operator_manages_and_no_wildcards(helm: str) -> None:
    objs = template(helm)
    for o in objs:
        for rule in o.get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], (o["metadata"]["name"], rule)
    workloads = _rules(objs, "ClusterRole", "rel-dsv4-operator-dsv4-system-workloads")
    granted = {
        (g, r): set(rule["verbs"]) for rule in workloads for g in rule["apiGroups"] for r in rule["resources"]
    }
    for api_version, kind in apply.CHILD_KINDS:
        group = api_version.split("/")[0] if "/" in api_version else ""
        assert granted[(group, plural(kind))] >= VERBS, kind
    assert granted[("", "pods")] == {"get", "list", "watch"}
    assert granted[("dsv4.ai", "dsv4deployments/status")] == {"get", "patch"}


def test_namespaced_install_uses_roles_only(helm: str) -> None:
    objs = template(helm, "--set", "watchNamespaces={team-a,team-b}")
    roles = [
        o for o in objs if o["kind"] == "Role" and o["metadata"]["name"] == "rel-dsv4-operator-dsv4-system"
    ]
    assert {r["metadata"]["namespace"] for r in roles} == {"team-a", "team-b"}
    assert not [
        o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("-workloads")
    ]
    args = pod_spec(objs)["containers"][0]["args"]
    assert "--watch-namespace=team-a" in args


def test_operator_deployment_has_probe_metrics_and_webhook(helm: str) -> None:
    objs = template(helm)
    c = pod_spec(objs)["containers"][0]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert {p["name"] for p in c["ports"]} == {"webhook", "metrics", "healthz"}
    assert "--leader-elect" in c["args"] and "--webhook" in c["args"]
    assert "--webhook-service=rel-dsv4-operator-webhook" in c["args"]  # registered by Service, not URL
    assert pod_spec(objs)["securityContext"]["runAsNonRoot"] is True
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "Service"} == {
        "rel-dsv4-operator-webhook",
        "rel-dsv4-operator-metrics",
    }
