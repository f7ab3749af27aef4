"""Tier 5: `helm install` the chart, `kubectl apply` the CPU example as it is (its image path
/opt/dsv4/models/tiny is the agent's engine-cpu image holding the test's tiny checkpoint), and the
cluster really serves. The scenarios run in order on one deployment, deleted by the last one.

Requests go to the router pod's own address from threads inside the node namespace: this tier has
no Service proxy (the endpoint Service exists and is checked, but nothing implements cluster IPs).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from serving import (
    CHAT,
    EXAMPLE,
    MODEL,
    NAME,
    NAMESPACE,
    NS,
    RELEASE,
    Endpoints,
    Load,
    assert_pair_refused,
    client,
    colocated,
    counter,
    is_ready,
    operator_pods,
    pair_request,
    pods,
    port_of,
    router_url,
    stray_prefill,
    streamed_chat,
)

from suite import skips
from suite.realkube import free_port

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(900)]
START = 300.0  # three engines loading on a loaded 2-core machine


def ready_condition(kube: Any) -> dict[str, Any] | None:
    status = kube.get("dsv4", NAME, "-n", NS).get("status") or {}
    cond = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), None)
    return status if cond and cond["status"] == "True" else None


@pytest.fixture(scope="module")
def deployment(kube: Any, node: Any, operator_release: Any, until: Any) -> dict[str, Any]:
    kube.kubectl("apply", "-n", NS, "-f", str(EXAMPLE))

    def ready() -> dict[str, Any] | None:
        for pod in pods(kube, "decode") + pods(kube, "prefill") + pods(kube, "router"):
            for c in pod.get("status", {}).get("containerStatuses") or []:
                if c["restartCount"] > 0:  # a crash loop: fail now, with its log
                    raise AssertionError(f"{pod['metadata']['name']} restarted:\n{node.pod_logs(pod)}")
        return ready_condition(kube)

    return until(ready, START, "the Dsv4Deployment to be Ready")


@pytest.fixture(scope="module")
def references(
    tiny_model: Path, tiny_model_v2: Path, tmp_path_factory: pytest.TempPathFactory, until: Any
) -> dict[str, str]:
    """Each checkpoint's greedy reply from a colocated server (the same engine flags and thread
    count as the pods), one after the other."""
    out = {}
    for name, model in (("tiny", tiny_model), ("tiny-v2", tiny_model_v2)):
        log = tmp_path_factory.mktemp("colocated") / f"{name}.log"
        with colocated(model, free_port(), log) as base:
            healthy = lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200  # noqa: E731
            until(healthy, START, f"the colocated server ({log})")
            out[name] = streamed_chat(f"{base}/v1")
    assert out["tiny"] != out["tiny-v2"]  # the revisions tell apart by their output
    return out


@pytest.fixture(scope="module")
def reference(references: dict[str, str]) -> str:
    return references["tiny"]


def in_node(node: Any, fn: Any, *args: Any, timeout: float = 300) -> Any:
    with node.pool(1) as pool:
        return pool.submit(fn, *args).result(timeout=timeout)


def test_the_cpu_example_serves_through_the_router_like_a_colocated_server(
    reference: str, kube: Any, node: Any, operator_release: dict[str, Any], deployment: dict[str, Any]
) -> None:
    # The operator is the chart's pod, under the chart's ServiceAccount: the API server saw the
    # children applied by that account (its token, mounted by the agent, is the only way in).
    op = operator_release
    assert op["spec"]["nodeName"] == "dsv4-test-node"
    account = op["spec"]["serviceAccountName"]
    assert account == f"{RELEASE}-dsv4-operator"
    writes = kube.writes_since(0, user=f"system:serviceaccount:{NAMESPACE}:{account}", namespace=NS)
    assert [w for w in writes if w.startswith("patch statefulsets/")], writes
    sts = {s["metadata"]["name"]: s for s in kube.get("statefulsets", "-n", NS)["items"]}
    roles = {s["metadata"]["labels"]["dsv4.ai/role"] for s in sts.values()}
    assert roles == {"prefill", "decode"}, sts.keys()
    for role in ("prefill", "decode", "router"):
        (pod,) = pods(kube, role)
        assert pod["spec"]["nodeName"] == "dsv4-test-node" and is_ready(pod), pod["status"]
    # Distinct pod addresses, each inside the node's pod network.
    ips = {p["status"]["podIP"] for r in ("prefill", "decode", "router") for p in pods(kube, r)}
    assert len(ips) == 3 and all(ip.startswith("10.244.0.") for ip in ips)
    assert deployment["endpoint"] == f"http://{NAME}.{NS}.svc:8000"
    assert kube.get("service", NAME, "-n", NS)["spec"]["selector"]["dsv4.ai/role"] == "router"

    # The router finds its servers by its own Kubernetes discovery (selectors with the fingerprint),
    # never by an address in its arguments.
    (router,) = pods(kube, "router")
    args = router["spec"]["containers"][0]["args"]
    assert "--service-discovery" in args and not [a for a in args if a.startswith("http")], args
    assert "Starting K8s service discovery | PD mode" in node.log_of(router, "router")
    url = router_url(kube)
    (prefill,) = pods(kube, "prefill")
    (decode,) = pods(kube, "decode")
    base = lambda p: f"http://{p['status']['podIP']}:{port_of(p)}"  # noqa: E731
    before = in_node(node, counter, base(decode), "vllm:generation_tokens")
    got = in_node(node, streamed_chat, url)
    assert got == reference and got
    # The router paired them: the decode pod generated the tokens, the prefill pod saw the prompt.
    assert in_node(node, counter, base(decode), "vllm:generation_tokens") >= before + 12
    assert in_node(node, counter, base(prefill), "vllm:prompt_tokens") > 0


def _outcome(url: str, max_tokens: int) -> tuple[str, str | None, int]:
    """(kind, finish_reason, chunks) of one streamed chat: kind 'ok' or the error's type name."""
    chunks, finish = 0, None
    try:
        stream = client(url).chat.completions.create(
            model=MODEL, messages=CHAT, stream=True, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for ch in stream:
            if ch.choices:
                chunks += 1
                finish = ch.choices[0].finish_reason or finish
    except Exception as exc:  # an error is an acceptable outcome here; a hang is not
        return type(exc).__name__, finish, chunks
    return "ok", finish, chunks


def test_a_killed_decode_pod_is_recreated_and_pairs_again(
    reference: str, kube: Any, node: Any, deployment: dict[str, Any], until: Any
) -> None:
    (old,) = pods(kube, "decode")
    url, decode = router_url(kube), f"http://{old['status']['podIP']}:{port_of(old)}"
    with node.pool(3) as pool:
        flying = [pool.submit(_outcome, url, 2000) for _ in range(2)]
        running = lambda: pool.submit(counter, decode, "vllm:num_requests_running").result(30)  # noqa: E731
        until(lambda: running() >= 1, 120, "a request running on the decode pod")
        kube.kubectl("delete", "pod", old["metadata"]["name"], "-n", NS, "--grace-period=0", "--force")
        # None hangs: each ends (with an error, or complete) well within the client's timeout.
        outcomes = [f.result(timeout=90) for f in flying]
    for kind, finish, _ in outcomes:
        assert kind != "APITimeoutError" and (kind != "ok" or finish == "length"), outcomes

    def recreated() -> dict[str, Any] | None:
        got = [p for p in pods(kube, "decode") if is_ready(p)]
        return got[0] if got and got[0]["metadata"]["uid"] != old["metadata"]["uid"] else None

    new = until(recreated, START, "the StatefulSet's new decode pod to be Ready")
    assert new["metadata"]["name"] == old["metadata"]["name"]
    assert new["status"]["podIP"] != old["status"]["podIP"]
    # It pairs again: the router forgot the deleted pod and found the new one.
    until(lambda: in_node(node, streamed_chat, url) == reference, 180, "a reply through the new decode pod")
    new_base = f"http://{new['status']['podIP']}:{port_of(new)}"
    assert in_node(node, counter, new_base, "vllm:generation_tokens") >= 12


def test_a_killed_engine_process_is_restarted_in_its_pod(
    reference: str, kube: Any, node: Any, deployment: dict[str, Any], until: Any
) -> None:
    (pod,) = pods(kube, "decode")
    (status,) = pod["status"]["containerStatuses"]
    pid = int(status["containerID"].removeprefix("harness://"))
    os.kill(pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        (p,) = pods(kube, "decode")
        (s,) = p["status"]["containerStatuses"]
        return s if s["restartCount"] == status["restartCount"] + 1 and s["ready"] else None

    s = until(restarted, START, "the agent to restart the decode container and it to be Ready")
    assert s["lastState"]["terminated"]["exitCode"] == 137  # 128 + SIGKILL, as a runtime reports
    assert s["lastState"]["terminated"]["signal"] == signal.SIGKILL
    url = router_url(kube)
    until(lambda: in_node(node, streamed_chat, url) == reference, 180, "a reply after the restart")


# A decoy worker: answers every request 200 with `{}` and logs it, one line per request.
DECOY = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def _any(self):
        print("REQUEST", self.command, self.path, flush=True)
        body = json.dumps({}).encode()
        self.send_response(200); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body))); self.end_headers(); self.wfile.write(body)
    do_GET = do_POST = do_PUT = do_DELETE = _any
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
"""


def _decoy(name: str, like: dict[str, Any], **labels: str) -> dict[str, Any]:
    """A Ready pod with `like`'s labels but `labels` changed, serving on its HTTP port: what a
    router whose selectors missed the deployment or the fingerprint would take for a decode worker."""
    c = like["spec"]["containers"][0]
    spec = {"terminationGracePeriodSeconds": 1, "containers": [{
        "name": "decoy", "image": c["image"], "imagePullPolicy": "Never", "command": ["python3", "-c", DECOY, str(port_of(like))],
        "ports": c["ports"]}]}  # fmt: skip
    meta = {"name": name, "namespace": NS, "labels": {**like["metadata"]["labels"], **labels}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def test_scaling_decode_to_two_under_load_and_back_fails_no_request(
    reference: str, kube: Any, node: Any, deployment: dict[str, Any], until: Any
) -> None:
    """16 streams through the router while decode scales to 2 and back: no request fails. Beside
    them, two decoy decode workers, one of another generation (fingerprint), one of another
    deployment: the router's selectors keep both out, so they get no request at all. They are Ready
    before the scale-up starts, so by the time the router sends load to the new decode pod it has
    seen them, and a router selecting them would have probed them or sent them load."""
    url = router_url(kube)
    (decode,) = pods(kube, "decode")
    decoys = {
        "decoy-generation": {"dsv4.ai/fingerprint": "decoy"},
        "decoy-deployment": {"dsv4.ai/deployment": "other"},
    }
    try:
        for name, labels in decoys.items():
            kube.kubectl("apply", "-f", "-", input=json.dumps(_decoy(name, decode, **labels)))
        live = lambda: [p for p in kube.get("pods", "-n", NS)["items"] if p["metadata"]["name"] in decoys]  # noqa: E731
        decoy_pods = until(lambda: (got := live()) and len(got) == 2 and all(is_ready(p) for p in got) and got,
                           120, "the decoys to be Ready")  # fmt: skip
        with Load(node, url, workers=16) as load:
            until(lambda: load.count() >= 16, 300, "the steady load to run")
            kube.kubectl("scale", "dsv4", NAME, "-n", NS, "--replicas=2")
            # The generation decoy carries the deployment's labels: only the fingerprint tells it apart.
            decodes = lambda: [p for p in pods(kube, "decode") if p["metadata"]["name"] not in decoys]  # noqa: E731
            ready = lambda: [p for p in decodes() if is_ready(p)]  # noqa: E731
            until(lambda: len(ready()) == 2, START, "two Ready decode pods")
            (joined,) = [p for p in ready() if p["metadata"]["name"].endswith("-1")]
            base = f"http://{joined['status']['podIP']}:{port_of(joined)}"
            with node.pool(1) as pool:
                served = lambda: pool.submit(counter, base, "vllm:generation_tokens").result(30) > 0  # noqa: E731
                until(served, 180, "the new decode pod to serve requests of the load")
            kube.kubectl("scale", "dsv4", NAME, "-n", NS, "--replicas=1")
            until(lambda: len(decodes()) == 1, 240, "decode-1 to drain and be removed")
            after = load.count()
            until(lambda: load.count() >= after + 16, 300, "the load to go on after the scale-down")
        for pod in decoy_pods:
            assert "REQUEST" not in node.log_of(pod, "decoy"), node.log_of(pod, "decoy")[-2000:]
        # The control: a request that does reach a decoy shows in its log.
        probe = decoy_pods[0]
        in_node(node, httpx.get, f"http://{probe['status']['podIP']}:{port_of(probe)}/health")
        until(lambda: "REQUEST GET /health" in node.log_of(probe, "decoy"), 30, "the decoy to log a request")
    finally:
        for name in decoys:
            kube.kubectl("delete", "pod", name, "-n", NS, "--ignore-not-found", "--grace-period=1")
        # A failure above leaves no second decode pod behind for the next scenario.
        kube.kubectl("scale", "dsv4", NAME, "-n", NS, "--replicas=1")
    assert not load.failures(), load.failures()[:5]
    assert all(text == reference for _, text in load.results)


def test_a_new_model_revision_rolls_out_under_load_and_never_mixes_generations(
    references: dict[str, str], kube: Any, node: Any, deployment: dict[str, Any], until: Any
) -> None:
    """A fingerprint change: the new generation starts beside the old, the endpoint (its Endpoints,
    what kube-proxy would route by) moves when it is Ready, the old drains; no request fails, and
    every reply is one checkpoint's own (a prefill of one generation paired with a decode of the
    other would answer with neither)."""
    generation = lambda: kube.get("service", NAME, "-n", NS)["spec"]["selector"]["dsv4.ai/fingerprint"]  # noqa: E731
    old = generation()
    endpoints = Endpoints(kube)
    try:
        with Load(node, endpoints.url, workers=2) as load:
            until(lambda: load.count() >= 2, 180, "the steady load to run")
            patch = {"spec": {"model": {"image": {"path": "/opt/dsv4/models/tiny-v2"}}}}
            kube.kubectl("patch", "dsv4", NAME, "-n", NS, "--type=merge", "-p", json.dumps(patch))
            new = until(lambda: generation() != old and generation(), START, "the endpoint to move")
            old_pods = lambda: kube.get("pods", "-n", NS, "-l", f"dsv4.ai/fingerprint={old}")["items"]  # noqa: E731
            until(lambda: not old_pods(), 240, "the old generation to drain and go")
            after = load.count()
            until(lambda: load.count() >= after + 2, 180, "the load to go on on the new generation")
    finally:
        endpoints.close()
    assert not load.failures(), load.failures()[:5]
    texts = [text for _, text in load.results]
    assert set(texts) <= {references["tiny"], references["tiny-v2"]}, set(texts)
    assert texts[0] == references["tiny"] and texts[-1] == references["tiny-v2"]
    assert len(endpoints.seen) >= 2, endpoints.seen  # the Service's address really moved
    status = until(lambda: ready_condition(kube), 120, "the resource Ready on the new generation")
    assert all(p["metadata"]["labels"]["dsv4.ai/fingerprint"] == new for p in pods(kube, "decode")), status


def _stray_prefill(kube: Any, until: Any) -> dict[str, Any]:
    """The example's first-revision prefill pod that no router selects (`serving.stray_prefill`)."""
    pod = stray_prefill(yaml.safe_load(EXAMPLE.read_text()), NS)
    kube.kubectl("apply", "-f", "-", input=json.dumps(pod))
    return until(lambda: next((p for p in kube.get("pods", "-n", NS, "-l", "app=stray")["items"] if is_ready(p)), None),
                 START, "the stray first-revision prefill pod to be Ready")  # fmt: skip


def test_the_layout_fingerprint_alone_refuses_a_cross_generation_pair(
    kube: Any, node: Any, deployment: dict[str, Any], until: Any
) -> None:
    """The router's selectors keep generations apart; were they wrong, the PD handshake still
    would: a second-revision decode refuses KV from a first-revision prefill, naming the field."""
    (decode,) = pods(kube, "decode")
    assert decode["spec"]["containers"][0]["args"][1] == "/opt/dsv4/models/tiny-v2"  # after the rollout
    (router,) = pods(kube, "router")  # the first guard: it only ever lists pods of its generation
    fp = router["metadata"]["labels"]["dsv4.ai/fingerprint"]
    args = router["spec"]["containers"][0]["args"]
    for flag in ("--prefill-selector", "--decode-selector"):
        assert f"dsv4.ai/fingerprint={fp}" in args[args.index(flag) + 1 : args.index(flag) + 5], args
    try:
        stray = _stray_prefill(kube, until)
        body = pair_request(MODEL, stray, random.randrange(2**63))
        base = lambda p: f"http://{p['status']['podIP']}:{port_of(p)}"  # noqa: E731
        with node.pool(2) as pool:
            assert_pair_refused(pool, body, base(stray), base(decode))
    finally:
        kube.kubectl("delete", "pod", "stray-prefill", "-n", NS, "--ignore-not-found", "--grace-period=5")


MONITORING, TEAM = "monitoring", {"dsv4.test/team": "monitoring"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}


def _probe(ip: str, port: int) -> str:
    """'open' or 'refused': a new TCP connection from the calling thread's namespace. The agent's
    rules refuse with a reset, so a refusal comes at once; the timeout only bounds a hang."""
    try:
        socket.create_connection((ip, port), timeout=30).close()
    except ConnectionRefusedError:
        return "refused"
    return "open"


def _idle_pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    image = yaml.safe_load(EXAMPLE.read_text())["spec"]["image"]  # an image the agent knows
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": MONITORING, "labels": labels},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [
                {"name": "idle", "image": image, "imagePullPolicy": "Never", "command": ["sleep", "infinity"]}]}}  # fmt: skip


def _token_ready(kube: Any) -> bool:
    """The namespace's default ServiceAccount has its token Secret: 1.20's admission refuses pods
    before that."""
    got = kube.kubectl("get", "serviceaccount", "default", "-n", MONITORING, "-o", "json", check=False)
    return got.returncode == 0 and bool(json.loads(got.stdout).get("secrets"))


def test_the_network_policy_admits_the_scraper_to_metrics_only(
    kube: Any, node: Any, deployment: dict[str, Any], until: Any
) -> None:
    """spec.networkPolicy on, with a scraper (Prometheus pods of namespaces labelled as monitoring
    ones), enforced by the agent's nftables rules: the scraper reaches the servers' metrics port and
    not their generation (or bootstrap) port, another pod of its namespace reaches neither, pods the
    policy does not select stay open, and the router still serves through the policy."""
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": MONITORING, "labels": TEAM}}
    kube.kubectl("apply", "-f", "-", input=json.dumps(ns))  # 1.20 has no kubernetes.io/metadata.name
    patch = {"spec": {"networkPolicy": {"enabled": True}, "monitoring": {"scraper": {
        "namespaceSelector": {"matchLabels": TEAM}, "podSelector": {"matchLabels": PROMETHEUS}}}}}  # fmt: skip
    off = {"spec": {"networkPolicy": {"enabled": False}, "monitoring": {"scraper": None}}}  # the example's
    if node.netpol()["disabled"]:
        skips.hardware("br_netfilter", node.netpol()["disabled"])
    try:
        until(lambda: _token_ready(kube), 60, "the monitoring namespace's ServiceAccount token")
        for name, labels in (("prometheus", PROMETHEUS), ("grafana", {"app.kubernetes.io/name": "grafana"})):
            kube.kubectl("apply", "-f", "-", input=json.dumps(_idle_pod(name, labels)))
        ready = lambda name: next((p for p in kube.get("pods", "-n", MONITORING)["items"]  # noqa: E731
                                   if p["metadata"]["name"] == name and is_ready(p)), None)  # fmt: skip
        scraper = until(lambda: ready("prometheus"), 120, "the scraper pod to run")
        other = until(lambda: ready("grafana"), 120, "the other monitoring pod to run")
        kube.kubectl("patch", "dsv4", NAME, "-n", NS, "--type=merge", "-p", json.dumps(patch))
        servers = [p for role in ("prefill", "decode") for p in pods(kube, role)]
        (router,) = pods(kube, "router")

        def enforced() -> bool:
            """The agent applied a generation where each server admits the scraper on metrics."""
            isolated = node.netpol()["isolated"]
            return all(
                any(scraper["status"]["podIP"] in (a["sources"] or []) and a["port"] == port_of(p, "metrics")
                    for a in isolated.get(p["status"]["podIP"], []))
                for p in servers
            )  # fmt: skip

        until(enforced, 120, "the agent to enforce the rendered NetworkPolicy")
        assert router["status"]["podIP"] not in node.netpol()["isolated"]
        with node.pod_pool(scraper) as from_scraper, node.pod_pool(other) as from_other:
            for p in servers:
                ip, who = p["status"]["podIP"], p["metadata"]["name"]
                ports = {c["name"]: c["containerPort"] for c in p["spec"]["containers"][0]["ports"]}
                url = f"http://{ip}:{ports['metrics']}/metrics"
                got = from_scraper.submit(httpx.get, url, timeout=30).result(60)
                assert got.status_code == 200 and "vllm:" in got.text, (who, got.status_code)
                for name, port in ports.items():  # http, metrics, and bootstrap on prefill
                    if name != "metrics":
                        assert from_scraper.submit(_probe, ip, port).result(60) == "refused", (who, name)
                    assert from_other.submit(_probe, ip, port).result(60) == "refused", (who, name)
                # Refused by the policy, not closed: the node (whose traffic no policy filters) gets in.
                assert in_node(node, _probe, ip, ports["http"]) == "open", who
            # The router, which the policy does not select, stays open to anyone.
            assert from_other.submit(_probe, router["status"]["podIP"], port_of(router)).result(60) == "open"
        # Through the policy: router to both servers' HTTP ports, prefill and decode to each other.
        assert in_node(node, streamed_chat, router_url(kube))
        # Off again: the agent drops the rules, the servers open to the other pod again.
        kube.kubectl("patch", "dsv4", NAME, "-n", NS, "--type=merge", "-p", json.dumps(off))
        until(lambda: not node.netpol()["isolated"], 120, "the agent to drop the rules")
        with node.pod_pool(other) as from_other:
            ip = servers[0]["status"]["podIP"]
            assert from_other.submit(_probe, ip, port_of(servers[0])).result(60) == "open"
    finally:  # as the example has it, for the scenarios after this one
        kube.kubectl("patch", "dsv4", NAME, "-n", NS, "--type=merge", "-p", json.dumps(off), check=False)
        kube.kubectl("delete", "namespace", MONITORING, "--wait=false", "--ignore-not-found")
    until(lambda: not kube.get("pods", "-n", MONITORING)["items"], 120, "the monitoring pods to go")


def test_deleting_the_resource_removes_every_process_and_object(
    kube: Any, node: Any, deployment: dict[str, Any], until: Any
) -> None:
    kube.kubectl("delete", "dsv4", NAME, "-n", NS, "--wait=false")
    kinds = (
        "pods,statefulsets,deployments,replicasets,services,configmaps,serviceaccounts,roles,rolebindings,pdb"
    )
    left = lambda: kube.get(kinds, "-n", NS, "-l", f"dsv4.ai/deployment={NAME}")["items"]  # noqa: E731
    until(lambda: not left(), 240, "every child to be garbage-collected")
    assert kube.kubectl("get", "dsv4", NAME, "-n", NS, check=False).returncode != 0
    # Nothing of it runs: no process holds the image's model path, only the operator pods'
    # namespaces are left beside the node's.
    until(lambda: not model_processes(), 60, "every server and router process to exit")
    operators = {node.namespace_of(p) for p in operator_pods(kube)}
    assert len(operators) == 2
    until(lambda: set(node.pod_namespaces()) == operators, 60, "the pods' network namespaces to be deleted")


def model_processes() -> list[str]:
    """The model-serving processes of pods: those in a network namespace other than this test's. Other
    tests (another xdist worker's `dsv4 serve`) run the same model in the host's namespace."""
    host = os.stat("/proc/self/ns/net").st_ino
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            in_pod = os.stat(entry / "ns" / "net").st_ino != host
        except OSError:
            continue
        if in_pod and "/opt/dsv4/models/tiny" in cmd:
            found.append(cmd)
    return found
