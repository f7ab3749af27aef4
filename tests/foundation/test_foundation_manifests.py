"""spec -> plan -> manifests: every rendered object, checked against the Kubernetes schemas, the label
contract, sglang-router 0.3.2's own argument parser, and the security rules."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dsv4_engine.server.args import build_parser as serve_parser
from dsv4_operator.fingerprint import deployment_fingerprint
from dsv4_operator.manifests import is_generation_scoped, render
from dsv4_operator.plan import A_BOOTSTRAP_PORT, L_FINGERPRINT, POD_MONITOR_API, plan
from dsv4_operator.render import dump
from dsv4_operator.spec import NAME_MAX, SpecError, parse

ROOT = Path(__file__).resolve().parents[2]
VALID = sorted((ROOT / "examples").glob("*.yaml"))
K8S_VERSION = "1.30.0"  # kubernetes-validate ships 1.25-1.37; 1.30 is a common production floor

Make = Callable[..., dict[str, Any]]
Objs = list[dict[str, Any]]


def objects(obj: dict[str, Any], **kw: Any) -> Objs:
    return render(parse(obj), **kw)


def find(objs: Objs, kind: str, role: str | None = None) -> dict[str, Any]:
    hits = [
        o
        for o in objs
        if o["kind"] == kind and (role is None or o["metadata"]["labels"].get("dsv4.ai/role") == role)
    ]
    assert len(hits) == 1, f"{len(hits)} {kind} {role}"
    return hits[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics (matchLabels + In/NotIn/Exists/DoesNotExist)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        if (op == "In" and value not in e["values"]) or (op == "NotIn" and value in e["values"]):
            return False
        if (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_every_object_validates_against_kubernetes_schemas(path: Path) -> None:
    objs = objects(yaml.safe_load(path.read_text()))
    for o in objs:
        assert "ownerReferences" not in o["metadata"]  # the operator adopts
        if o["apiVersion"] == POD_MONITOR_API:  # not a built-in kind: tests/operator checks its shape
            continue
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_rendering_is_deterministic(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    first = dump(objects(obj))

    # Same spec with every mapping's keys in reverse order: byte-identical output.
    def reverse(x: Any) -> Any:
        return {k: reverse(x[k]) for k in reversed(list(x))} if isinstance(x, dict) else x

    assert dump(objects(reverse(obj))) == first
    assert dump(objects(obj)) == first


def test_inventory_and_names(minimal: dict[str, Any]) -> None:
    objs = objects(minimal)
    fp = deployment_fingerprint(parse(minimal))
    got = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert got == [
        ("ServiceAccount", "dsv4-router"),
        ("Role", "dsv4-router"),
        ("RoleBinding", "dsv4-router"),
        ("ConfigMap", f"dsv4-engine-{fp}"),
        ("Service", f"dsv4-prefill-{fp}"),
        ("Service", f"dsv4-decode-{fp}"),
        ("StatefulSet", f"dsv4-prefill-{fp}"),
        ("StatefulSet", f"dsv4-decode-{fp}"),
        ("Deployment", f"dsv4-router-{fp}"),
        ("Service", "dsv4"),
        ("PodDisruptionBudget", f"dsv4-prefill-{fp}"),
        ("PodDisruptionBudget", f"dsv4-decode-{fp}"),
        ("PodDisruptionBudget", f"dsv4-router-{fp}"),
        ("NetworkPolicy", "dsv4-workers"),
    ]
    for o in objs:
        assert o["metadata"]["namespace"] == "default"
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "dsv4"
        assert labels["app.kubernetes.io/instance"] == labels["dsv4.ai/deployment"] == "dsv4"
        assert is_generation_scoped(o) == (fp in o["metadata"]["name"])
        if is_generation_scoped(o):
            assert labels[L_FINGERPRINT] == fp


def test_longest_name_fits_every_limit(minimal: dict[str, Any]) -> None:
    minimal["metadata"]["name"] = "a" * NAME_MAX
    for o in objects(minimal):
        assert len(o["metadata"]["name"]) <= 63
        if o["kind"] == "StatefulSet":
            # controller-revision-hash label = "<name>-<10 chars>" must stay a valid label value.
            assert len(o["metadata"]["name"]) <= 52


def test_worker_statefulsets(minimal: dict[str, Any]) -> None:
    dep = parse(minimal)
    objs = render(dep)
    p = plan(dep)
    for role in ("prefill", "decode"):
        sts = find(objs, "StatefulSet", role)
        spec, pod = sts["spec"], sts["spec"]["template"]
        assert spec["podManagementPolicy"] == "Parallel"
        assert spec["serviceName"] == find(objs, "Service", role)["metadata"]["name"]
        assert spec["replicas"] == 1
        assert matches(spec["selector"], pod["metadata"]["labels"])
        assert pod["metadata"]["labels"]["dsv4.ai/role"] == role
        assert pod["metadata"]["labels"][L_FINGERPRINT] == p.fingerprint
        annotations = pod["metadata"].get("annotations", {})
        assert (annotations.get(A_BOOTSTRAP_PORT) == "8998") == (role == "prefill")
        ps = pod["spec"]
        assert ps["automountServiceAccountToken"] is False
        assert ps["securityContext"]["runAsNonRoot"] is True and ps["securityContext"]["runAsUser"] == 1000
        c = container(sts)
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert c["command"] == ["dsv4-ascend", "serve"]  # the engine-ascend entrypoint (CANN set_env)
        serve_parser().parse_args(c["args"])  # the real `dsv4 serve` parser accepts them (exits if not)
        args = dict(zip(c["args"][::2], c["args"][1::2], strict=True))
        assert args["--disaggregation-mode"] == role
        assert args["--model"] == "/models/DeepSeek-V4"
        assert (args["--tp-size"], args["--ep-size"], args["--transfer-protocol"]) == ("8", "1", "ascend")
        assert args["--bootstrap-port"] == "8998"  # decode: the port a null bootstrap_port means
        ports = {x["name"]: x["containerPort"] for x in c["ports"]}
        want = {"http": 30000, "metrics": 29100} | ({"bootstrap": 8998} if role == "prefill" else {})
        assert ports == want
        assert args["--metrics-port"] == "29100"
        assert c["resources"]["limits"]["huawei.com/Ascend910"] == "8"
        assert c["resources"]["requests"]["huawei.com/Ascend910"] == "8"
        env = env_of(c)
        assert env["HCCL_IF_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["HCCL_SOCKET_IFNAME"] == "eth0"
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in ps["volumes"]}
        assert volumes["hccn-conf"]["hostPath"] == {"path": "/etc/hccn.conf", "type": "File"}
        assert mounts["hccn-conf"] == {"name": "hccn-conf", "mountPath": "/etc/hccn.conf", "readOnly": True}
        assert volumes["model"]["persistentVolumeClaim"] == {
            "claimName": "deepseek-v4-weights",
            "readOnly": True,
        }
        assert mounts["model"]["readOnly"] is True
        assert volumes["engine-config"]["configMap"]["name"] == p.config_map
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        assert ps["terminationGracePeriodSeconds"] > dep.spec.engine.grace_period_seconds


def test_probes_tolerate_long_model_loads(with_spec: Make) -> None:
    for timeout in (60, 3600, 5401):
        objs = objects(with_spec(probes={"startupTimeoutSeconds": timeout}))
        c = container(find(objs, "StatefulSet", "decode"))
        startup = c["startupProbe"]
        assert startup["httpGet"] == {"path": "/health", "port": "http"}
        assert startup["failureThreshold"] * startup["periodSeconds"] >= timeout
        assert startup["failureThreshold"] * startup["periodSeconds"] < timeout + startup["periodSeconds"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        # Liveness starts only after the startup probe passed: it must not be as patient.
        assert c["livenessProbe"]["failureThreshold"] * c["livenessProbe"]["periodSeconds"] <= 300


def test_compiled_decode_keeps_its_artefacts_and_the_prefix_cache_can_be_off(with_spec: Make) -> None:
    """engine.enforceEager false: `--no-enforce-eager`, and the compiled decode steps go to an emptyDir
    that outlives the container (a restarted engine loads them); engine.prefixCache false:
    `--disable-radix-cache`. The defaults pass neither flag and mount no compile cache."""
    for eager, cached in ((True, True), (False, False)):
        objs = objects(with_spec(engine={"enforceEager": eager, "prefixCache": cached}))
        for role in ("prefill", "decode"):
            sts = find(objs, "StatefulSet", role)
            c, volumes = container(sts), {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
            parsed = serve_parser().parse_args(c["args"])
            assert (parsed.enforce_eager, parsed.disable_radix_cache) == (eager, not cached)
            assert ("--no-enforce-eager" in c["args"]) == (not eager)
            assert ("--disable-radix-cache" in c["args"]) == (not cached)
            mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
            if eager:
                assert "compile-cache" not in volumes and "TORCHINDUCTOR_CACHE_DIR" not in env_of(c)
                continue
            assert volumes["compile-cache"] == {"name": "compile-cache", "emptyDir": {}}
            assert env_of(c)["TORCHINDUCTOR_CACHE_DIR"] == f"{mounts['compile-cache']}/inductor"


def test_prefix_cache_volume_is_mounted_on_prefill_and_passed_as_its_directory(with_spec: Make) -> None:
    """engine.prefixCacheVolume: the claim is mounted read-write on prefill pods only (the decode
    caches nothing) and `dsv4 serve` gets the mount, or the path inside it, as --prefix-cache-dir;
    without it no pod mounts one or passes the flag."""
    for path in (None, "dsv4/prefixes"):
        vol = {"claimName": "prefix-cache-claim", **({"path": path} if path else {})}
        objs = objects(with_spec(engine={"prefixCacheVolume": vol}))
        for role in ("prefill", "decode"):
            sts = find(objs, "StatefulSet", role)
            c, volumes = container(sts), {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
            mounts = {m["name"]: m for m in c["volumeMounts"]}
            parsed = serve_parser().parse_args(c["args"])
            if role == "decode":
                assert "prefix-cache" not in volumes and parsed.prefix_cache_dir is None
                continue
            assert volumes["prefix-cache"] == {
                "name": "prefix-cache",
                "persistentVolumeClaim": {"claimName": "prefix-cache-claim"},
            }
            mount = mounts["prefix-cache"]
            assert not mount.get("readOnly")
            # The pod's grace covers writing the cache after the drain's grace period.
            decode = find(objs, "StatefulSet", "decode")["spec"]["template"]["spec"]
            grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace >= decode["terminationGracePeriodSeconds"] + 60
            assert parsed.prefix_cache_dir == (f"{mount['mountPath']}/{path}" if path else mount["mountPath"])
    for role in ("prefill", "decode"):
        c = container(find(objects(with_spec()), "StatefulSet", role))
        assert "--prefix-cache-dir" not in c["args"]


def test_prefix_cache_volume_size_cap_and_save_interval_reach_the_prefill(with_spec: Make) -> None:
    """maxSize and saveIntervalSeconds become the prefill server's --prefix-cache-max-bytes and
    --prefix-cache-save-interval, as the real `dsv4 serve` parser reads them; unset, neither flag is
    passed (the engine's defaults); a size the engine would not read is refused by the spec."""
    vol = {"claimName": "prefix-cache-claim", "maxSize": "20Gi", "saveIntervalSeconds": 0}
    parsed = serve_parser().parse_args(
        container(find(objects(with_spec(engine={"prefixCacheVolume": vol})), "StatefulSet", "prefill"))[
            "args"
        ]
    )
    assert (parsed.prefix_cache_max_bytes, parsed.prefix_cache_save_interval) == (20 * 2**30, 0.0)
    args = container(
        find(objects(with_spec(engine={"prefixCacheVolume": {"claimName": "c"}})), "StatefulSet", "prefill")
    )["args"]
    assert "--prefix-cache-max-bytes" not in args and "--prefix-cache-save-interval" not in args
    with pytest.raises(SpecError, match=re.escape("spec.engine.prefixCacheVolume.maxSize")):
        parse(with_spec(engine={"prefixCacheVolume": {"claimName": "c", "maxSize": "20G"}}))


def test_speculative_decoding_reaches_both_roles(with_spec: Make) -> None:
    """engine.speculativeNumSteps: `--speculative-num-steps N` on prefill (its MTP layer drafts the
    first decode step) and decode, as the real `dsv4 serve` parser reads it; 0 passes nothing."""
    for steps in (0, 3):
        objs = objects(with_spec(engine={"speculativeNumSteps": steps}))
        for role in ("prefill", "decode"):
            c = container(find(objs, "StatefulSet", role))
            parsed = serve_parser().parse_args(c["args"])
            assert (parsed.speculative_num_steps or 0) == steps
            assert ("--speculative-num-steps" in c["args"]) == (steps > 0)


def test_cpu_example_has_no_ascend_settings() -> None:
    objs = objects(yaml.safe_load((ROOT / "examples" / "cpu-tiny.yaml").read_text()))
    for role in ("prefill", "decode"):
        sts = find(objs, "StatefulSet", role)
        c = container(sts)
        assert not {"HCCL_IF_IP", "HCCL_SOCKET_IFNAME"} & set(env_of(c))
        assert all("huawei.com" not in k for part in c["resources"].values() for k in part)
        names = {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}
        assert names == {"engine-config", "dshm", "tmp"}  # weights are baked into the image
        args = dict(zip(c["args"][::2], c["args"][1::2], strict=True))
        assert (args["--model"], args["--device"], args["--transfer-protocol"]) == (
            "/opt/dsv4/models/tiny",
            "cpu",
            "tcp",
        )
    assert not [o for o in objs if o["kind"] == "NetworkPolicy"]


def test_ascend_1980_example_uses_its_resource_name_and_host_path() -> None:
    objs = objects(yaml.safe_load((ROOT / "examples" / "ascend-1980.yaml").read_text()))
    sts = find(objs, "StatefulSet", "decode")
    c = container(sts)
    assert c["resources"]["limits"] == {"huawei.com/ascend-1980": "4"}
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/data/models/DeepSeek-V4-Flash", "type": "Directory"}
    assert "ascend-driver" not in volumes
    assert env_of(c)["HCCL_SOCKET_IFNAME"] == "enp189s0f0"


def test_headless_services(minimal: dict[str, Any]) -> None:
    objs = objects(minimal)
    for role in ("prefill", "decode"):
        svc = find(objs, "Service", role)
        assert svc["spec"]["clusterIP"] == "None"
        pod_labels = find(objs, "StatefulSet", role)["spec"]["template"]["metadata"]["labels"]
        assert matches({"matchLabels": svc["spec"]["selector"]}, pod_labels)
        assert {p["name"] for p in svc["spec"]["ports"]} == (
            {"http", "bootstrap", "metrics"} if role == "prefill" else {"http", "metrics"}
        )


def router_args(objs: Objs, env: dict[str, str]) -> list[str]:
    args = container(find(objs, "Deployment", "router"))["args"]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_router_discovers_exactly_this_generation(minimal: dict[str, Any]) -> None:
    from sglang_router.launch_router import parse_router_args
    from sglang_router.router import Router

    objs = objects(minimal)
    deploy = find(objs, "Deployment", "router")
    c = container(deploy)
    assert c["command"] == ["python3", "-m", "sglang_router.launch_router"]
    assert env_of(c)["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    ra = parse_router_args(router_args(objs, {"POD_NAMESPACE": "default"}))
    assert ra.pd_disaggregation and ra.service_discovery
    assert ra.service_discovery_namespace == "default"
    assert ra.service_discovery_port == 30000
    for role, selector in (("prefill", ra.prefill_selector), ("decode", ra.decode_selector)):
        assert selector == find(objs, "StatefulSet", role)["spec"]["selector"]["matchLabels"]
        assert L_FINGERPRINT in selector
        other = "decode" if role == "prefill" else "prefill"
        other_labels = find(objs, "StatefulSet", other)["spec"]["template"]["metadata"]["labels"]
        assert not matches({"matchLabels": selector}, other_labels)
    assert ra.bootstrap_port_annotation == A_BOOTSTRAP_PORT
    assert (ra.prefill_policy, ra.decode_policy) == ("cache_aware", "power_of_two")
    assert ra.tokenizer_path == "/models/DeepSeek-V4"
    assert ra.api_key is None and "DSV4_API_KEY" not in env_of(c)
    assert ra.worker_startup_timeout_secs >= 3600
    Router.from_args(ra)  # the Rust side accepts the configuration (nothing is started)
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "dsv4-router"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_no_pod_ip_in_any_argument() -> None:
    ip = re.compile(r"\b\d{1,3}(\.\d{1,3}){3}\b")
    for path in VALID:
        for o in objects(yaml.safe_load(path.read_text())):
            if o["kind"] in ("StatefulSet", "Deployment"):
                for arg in container(o)["args"]:
                    assert not ip.search(arg) or arg == "0.0.0.0", (path.name, arg)


def test_api_key_comes_from_the_secret(with_spec: Make) -> None:
    from sglang_router.launch_router import parse_router_args

    objs = objects(with_spec(apiKeySecret={"name": "dsv4-key", "key": "token"}))
    c = container(find(objs, "Deployment", "router"))
    assert env_of(c)["DSV4_API_KEY"] == {"secretKeyRef": {"name": "dsv4-key", "key": "token"}}
    assert (
        parse_router_args(router_args(objs, {"POD_NAMESPACE": "x", "DSV4_API_KEY": "s3cret"})).api_key
        == "s3cret"
    )
    assert "s3cret" not in dump(objs)


def test_router_rbac_is_least_privilege(minimal: dict[str, Any]) -> None:
    objs = objects(minimal)
    role = find(objs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = find(objs, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "dsv4-router",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dsv4-router", "namespace": "default"}]
    assert find(objs, "ServiceAccount")["metadata"]["name"] == "dsv4-router"
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_endpoint_service_follows_serving_fingerprint(with_spec: Make) -> None:
    obj = with_spec(service={"type": "NodePort", "port": 80, "nodePort": 30080, "annotations": {"a": "b"}})
    objs = objects(obj)
    svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "dsv4")
    assert svc["spec"]["type"] == "NodePort"
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP", "nodePort": 30080}
    ]
    assert svc["metadata"]["annotations"] == {"a": "b"}
    router_labels = find(objs, "Deployment", "router")["spec"]["template"]["metadata"]["labels"]
    assert matches({"matchLabels": svc["spec"]["selector"]}, router_labels)
    assert not is_generation_scoped(svc)
    # While a new generation starts, the endpoint keeps selecting the old routers.
    old = "0123456789"
    moved = objects(obj, serving_fingerprint=old)
    svc = next(o for o in moved if o["kind"] == "Service" and o["metadata"]["name"] == "dsv4")
    assert svc["spec"]["selector"][L_FINGERPRINT] == old
    assert not matches({"matchLabels": svc["spec"]["selector"]}, router_labels)
    assert [o for o in moved if o["metadata"]["name"] != "dsv4"] == [
        o for o in objs if o["metadata"]["name"] != "dsv4"
    ]


def test_engine_config_map(minimal: dict[str, Any]) -> None:
    dep = parse(minimal)
    cm = find(render(dep), "ConfigMap")
    config = yaml.safe_load(cm["data"]["engine.yaml"])
    assert config["fingerprint"] == deployment_fingerprint(dep)
    assert config["engine"]["pageSize"] == 128
    args = shlex.split(cm["data"]["prefill.command"])
    assert args[:2] == ["dsv4-ascend", "serve"] and "--bootstrap-port" in args


def test_disruption_budgets(minimal: dict[str, Any]) -> None:
    objs = objects(minimal)
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    assert len(pdbs) == 3
    for pdb in pdbs:
        assert pdb["spec"]["maxUnavailable"] == 1
        role = pdb["metadata"]["labels"]["dsv4.ai/role"]
        kind = "Deployment" if role == "router" else "StatefulSet"
        workload = find(objs, kind, role)
        assert pdb["spec"]["selector"] == workload["spec"]["selector"]


def test_network_policy_isolates_servers(minimal: dict[str, Any]) -> None:
    objs = objects(minimal)
    np = find(objs, "NetworkPolicy")["spec"]
    labels = {r: find(objs, k, r)["spec"]["template"]["metadata"]["labels"] for r, k in
              (("prefill", "StatefulSet"), ("decode", "StatefulSet"), ("router", "Deployment"))}  # fmt: skip
    assert matches(np["podSelector"], labels["prefill"]) and matches(np["podSelector"], labels["decode"])
    assert not matches(np["podSelector"], labels["router"])
    assert np["policyTypes"] == ["Ingress"]
    peers, from_router = np["ingress"]
    # Servers reach each other on every port (bootstrap, Mooncake and HCCL pick theirs at run time).
    assert "ports" not in peers
    assert [matches(peers["from"][0]["podSelector"], labels[r]) for r in ("prefill", "decode", "router")] == [
        True,
        True,
        False,
    ]
    # The router reaches only the HTTP port.
    assert from_router["ports"] == [{"protocol": "TCP", "port": 30000}]
    assert matches(from_router["from"][0]["podSelector"], labels["router"])
    assert not matches(from_router["from"][0]["podSelector"], labels["prefill"])
    # Nothing from other namespaces or deployments.
    for rule in np["ingress"]:
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}
            assert peer["podSelector"]["matchLabels"]["dsv4.ai/deployment"] == "dsv4"


def test_scaling_changes_only_replicas(with_spec: Make, minimal: dict[str, Any]) -> None:
    before = objects(minimal)
    after = objects(with_spec(decode={"replicas": 7}))
    changed = [(a["kind"], a["metadata"]["name"]) for a, b in zip(after, before, strict=True) if a != b]
    assert changed == [("StatefulSet", find(before, "StatefulSet", "decode")["metadata"]["name"])]
    assert find(after, "StatefulSet", "decode")["spec"]["replicas"] == 7


def test_plan_selector_string(minimal: dict[str, Any]) -> None:
    p = plan(parse(minimal))
    sel = dict(kv.split("=") for kv in p.selector_string("decode").split(","))
    assert sel == p.decode.selector
    assert p.endpoint == "http://dsv4.default.svc:8000/v1"


def _walk(node: Any) -> Any:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_quantities_render_as_strings(path: Path) -> None:
    # Server-side apply on 1.20 rejects integer quantities; strings are the API's canonical form.
    obj = yaml.safe_load(path.read_text())
    obj["spec"].setdefault("decode", {})["resources"] = {"limits": {"cpu": 4, "memory": "8Gi"}}
    quantities = [
        q
        for node in _walk(objects(obj))
        for key, value in node.items()
        if key in ("requests", "limits") and isinstance(value, dict)
        for q in value.values()
    ] + [n["sizeLimit"] for n in _walk(objects(obj)) if "sizeLimit" in n]
    assert quantities and all(isinstance(q, str) for q in quantities), quantities


def test_rendered_objects_share_no_mutable_parts(minimal: dict[str, Any]) -> None:
    # The operator adopts (mutates) each child; a dict shared between children would leak across them.
    seen: dict[int, str] = {}
    for obj in objects(minimal):
        for node in _walk(obj):
            owner = seen.setdefault(id(node), f"{obj['kind']}/{obj['metadata']['name']}")
            assert owner == f"{obj['kind']}/{obj['metadata']['name']}", f"shared with {owner}"
