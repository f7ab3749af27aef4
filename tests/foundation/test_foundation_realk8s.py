"""The CRD and the rendered objects against a real Kubernetes 1.20 API server (the kube-apiserver that
scripts/build-kube.sh builds; skipped where it is absent). 1.20 has no CEL: it checks the no-CEL CRD
variant, the OpenAPI half of the drift test and the API server's own defaulting."""

from __future__ import annotations

import json
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsv4_operator import crdcheck
from dsv4_operator.crd import crd_yaml
from dsv4_operator.manifests import render
from dsv4_operator.plan import POD_MONITOR_API
from dsv4_operator.spec import parse
from suite import realkube, tools

pytestmark = [
    pytest.mark.realk8s,
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]
ROOT = Path(__file__).resolve().parents[2]
VALID = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))
TOKEN = "foundation-admin-token"


@pytest.fixture(scope="module")
def kubeconfig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    bins = realkube.binaries()
    apiserver, etcd = bins["apiserver"], bins["etcd"]
    d = tmp_path_factory.mktemp("kube")
    subprocess.run(["openssl", "genrsa", "-out", d / "sa.key", "2048"], check=True, capture_output=True)
    subprocess.run(
        ["openssl", "rsa", "-in", d / "sa.key", "-pubout", "-out", d / "sa.pub"],
        check=True,
        capture_output=True,
    )
    (d / "tokens.csv").write_text(f"{TOKEN},admin,admin,system:masters\n")
    client, peer, secure = realkube.free_port(), realkube.free_port(), realkube.free_port()
    procs = [
        subprocess.Popen(
            [etcd, "--data-dir", d / "etcd", f"--listen-client-urls=http://127.0.0.1:{client}",
             f"--advertise-client-urls=http://127.0.0.1:{client}", f"--listen-peer-urls=http://127.0.0.1:{peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
    ]  # fmt: skip
    procs.append(
        subprocess.Popen(
            [apiserver, f"--etcd-servers=http://127.0.0.1:{client}", "--bind-address=127.0.0.1",
             "--advertise-address=127.0.0.1", f"--secure-port={secure}", f"--cert-dir={d / 'certs'}",
             f"--token-auth-file={d / 'tokens.csv'}", "--authorization-mode=RBAC",
             "--service-account-issuer=https://kubernetes.default.svc",
             f"--service-account-key-file={d / 'sa.pub'}", f"--service-account-signing-key-file={d / 'sa.key'}",
             "--service-cluster-ip-range=10.0.0.0/24"],
            stdout=subprocess.DEVNULL, stderr=(d / "apiserver.log").open("w"),
        )
    )  # fmt: skip
    config = d / "kubeconfig"
    config.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": f"https://127.0.0.1:{secure}",
                            "insecure-skip-tls-verify": True,
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": TOKEN}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    try:
        deadline = time.monotonic() + 60
        while not _ready(secure):
            assert time.monotonic() < deadline, (d / "apiserver.log").read_text()[-2000:]
            time.sleep(0.2)
        for ns in ("inference", "llm"):
            kubectl_run(str(config), "create", "namespace", ns)
        yield str(config)
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=30)


def _ready(port: int) -> bool:
    request = urllib.request.Request(
        f"https://127.0.0.1:{port}/readyz", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=2, context=ssl._create_unverified_context()) as resp:
            return resp.read() == b"ok"
    except OSError:
        return False


def kubectl_run(config: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [tools.kubectl(), f"--kubeconfig={config}", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def crd_installed(kubeconfig: str) -> str:
    full = kubectl_run(kubeconfig, "apply", "-f", "-", stdin=crd_yaml(cel=True))
    assert full.returncode != 0 and "x-kubernetes-validations" in full.stderr  # why --no-cel exists
    stripped = kubectl_run(kubeconfig, "apply", "-f", "-", stdin=crd_yaml(cel=False))
    assert stripped.returncode == 0, stripped.stderr
    established = kubectl_run(
        kubeconfig, "wait", "--for=condition=established", "crd/dsv4deployments.dsv4.ai", "--timeout=30s"
    )
    assert established.returncode == 0, established.stderr
    return kubeconfig


@pytest.fixture(scope="module")
def api(crd_installed: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A dynamic client on the test API server (one process, no kubectl per request); its discovery
    cache in the test's own folder (by default a file in /tmp that outlives the run)."""
    from kubernetes import config as kconfig
    from kubernetes import dynamic

    cache = tmp_path_factory.mktemp("discovery") / "cache.json"
    return dynamic.DynamicClient(kconfig.new_client_from_config(crd_installed), cache_file=str(cache))


def create(api: Any, obj: dict[str, Any]) -> tuple[bool, Any]:
    from kubernetes.client.exceptions import ApiException

    resource = api.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    ns = obj["metadata"].get("namespace", "default")
    try:
        stored = resource.create(body=obj, namespace=ns).to_dict()
    except ApiException as exc:
        return False, exc.body
    resource.delete(name=obj["metadata"]["name"], namespace=ns)
    return True, stored


def test_valid_examples_stored_with_the_models_defaults(api: Any) -> None:
    for path in VALID:
        obj = yaml.safe_load(path.read_text())
        ok, stored = create(api, obj)
        assert ok, f"{path.name}: {stored}"
        assert stored["spec"] == parse(obj).spec_dict(), path.name


def test_server_schema_verdicts_match_the_offline_check(api: Any) -> None:
    for path in INVALID:
        obj = yaml.safe_load(path.read_text())
        accepted, detail = create(api, obj)
        offline = crdcheck.validate(obj, cel=False)
        if path.name == "typo-field.yaml":
            assert accepted and "tensorParalellSize" not in json.dumps(detail)  # pruned, as documented
            continue
        assert accepted == (not offline), (
            f"{path.name}: server {'accepted' if accepted else detail}, offline {offline}"
        )


def test_rendered_objects_pass_server_side_dry_run(api: Any) -> None:
    from kubernetes.client.exceptions import ApiException

    for path in VALID:
        for obj in render(parse(yaml.safe_load(path.read_text())), kube_minor=20):
            if obj["apiVersion"] == POD_MONITOR_API:  # its CRD is not installed there
                continue
            resource = api.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            try:
                resource.create(body=obj, namespace=obj["metadata"]["namespace"], dry_run="All")
            except ApiException as exc:
                pytest.fail(f"{path.name}: {obj['kind']} {obj['metadata']['name']}: {exc.body}")
