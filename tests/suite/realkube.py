"""The real tier's cluster, shared by tests/kube and tests/cluster: etcd + kube-apiserver +
kube-controller-manager v1.20.2 on 127.0.0.1, with an audit log of every write.

Binaries: DSV4_KUBE_APISERVER / DSV4_KUBE_CONTROLLER_MANAGER / DSV4_ETCD, else the cache that
scripts/build-kube.sh fills, else etcd on PATH; kubectl is the pinned one (suite/tools.py). Without
them the tier is skipped, unless the run is strict (the test command's), where it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from dsv4_operator.crd import crd_yaml
from suite import skips, tools

VERSION = "v1.20.2"
ADMIN_TOKEN, OPERATOR_TOKEN = "dsv4-test-admin", "dsv4-test-operator"
OPERATOR_USER = "dsv4-operator"
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection]
  - level: None
"""


def _binary(env: str, name: str) -> str | None:
    if os.environ.get(env):
        return os.environ[env]
    cache = os.environ.get("DSV4_KUBE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dsv4", "kube"
    )
    path = pathlib.Path(cache) / VERSION / "bin" / name
    return str(path) if path.is_file() else shutil.which(name)


def binaries() -> dict[str, str]:
    found = {
        "apiserver": _binary("DSV4_KUBE_APISERVER", "kube-apiserver"),
        "controller-manager": _binary("DSV4_KUBE_CONTROLLER_MANAGER", "kube-controller-manager"),
        "etcd": _binary("DSV4_ETCD", "etcd"),
    }
    missing = [k for k, v in found.items() if not v]
    if missing:
        skips.missing(
            f"real-kube tier needs {', '.join(missing)}: run scripts/build-kube.sh (or set DSV4_KUBE_*)"
        )
    return {**found, "kubectl": tools.kubectl()}  # type: ignore[dict-item]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
        except AssertionError:
            raise
        except Exception:  # a server still starting refuses connections
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


@dataclass
class Cluster:
    dir: pathlib.Path
    server: str
    kubeconfig: pathlib.Path
    operator_kubeconfig: pathlib.Path
    audit_log: pathlib.Path
    kubectl_bin: str
    wait = staticmethod(wait_until)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", *args],
            input=input, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr}")
        return proc

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", "-o", "json", *args).stdout)

    def audit_offset(self) -> int:
        return self.audit_log.stat().st_size

    def writes_since(self, offset: int, user: str = OPERATOR_USER, namespace: str | None = None) -> list[str]:
        """`verb resource/name` of every write `user` sent after `offset` (bytes into the audit log),
        only those into `namespace` when given."""
        with self.audit_log.open() as f:
            f.seek(offset)
            events = [json.loads(line) for line in f if line.strip()]
        out = []
        for e in events:
            if e.get("user", {}).get("username") == user and e.get("verb") in {
                "create",
                "update",
                "patch",
                "delete",
            }:
                ref = e.get("objectRef", {})
                if namespace is not None and ref.get("namespace") != namespace:
                    continue
                sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
                out.append(f"{e['verb']} {ref.get('resource')}{sub}/{ref.get('name', '')}")
        return out


def _kubeconfig(path: pathlib.Path, server: str, token: str) -> None:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "test",
                "clusters": [
                    {"name": "test", "cluster": {"server": server, "insecure-skip-tls-verify": True}}
                ],
                "users": [{"name": "test", "user": {"token": token}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
            }
        )
    )


def _start(args: list[str], log: pathlib.Path, procs: list[subprocess.Popen]) -> subprocess.Popen:
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(proc)
    return proc


def stop_procs(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):  # only what this fixture started, by its own process group
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _readyz(server: str) -> bool:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    req = urllib.request.Request(f"{server}/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
        return resp.status == 200


EGRESS = """apiVersion: apiserver.k8s.io/v1beta1
kind: EgressSelectorConfiguration
egressSelections:
  - name: cluster
    connection:
      proxyProtocol: HTTPConnect
      transport:
        uds:
          udsName: {socket}
"""


@contextlib.contextmanager
def run_cluster(d: pathlib.Path, egress_socket: pathlib.Path | None = None) -> Iterator[Cluster]:
    """etcd, kube-apiserver (audit log of writes) and kube-controller-manager in `d`; the CRD applied.

    egress_socket: the API server reaches the cluster network (webhooks, by Service: resolved to a
    Ready endpoint) through an HTTP CONNECT proxy listening there (tests/cluster's node agent)."""
    bins = binaries()
    procs: list[subprocess.Popen] = []
    try:
        subprocess.run(["openssl", "genrsa", "-out", d / "sa.key", "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", d / "sa.key", "-pubout", "-out", d / "sa.pub"],
                       check=True, capture_output=True)  # fmt: skip
        (d / "tokens.csv").write_text(
            f'{ADMIN_TOKEN},admin,admin,"system:masters"\n{OPERATOR_TOKEN},{OPERATOR_USER},op,"system:masters"\n'
        )
        (d / "audit-policy.yaml").write_text(AUDIT_POLICY)
        etcd_port, peer_port, api_port, kcm_port = (free_port() for _ in range(4))
        _start([bins["etcd"], "--data-dir", str(d / "etcd"), "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-cluster", f"default=http://127.0.0.1:{peer_port}"], d / "etcd.log", procs)  # fmt: skip
        audit_log = d / "audit.log"
        egress = []
        if egress_socket is not None:
            (d / "egress.yaml").write_text(EGRESS.format(socket=egress_socket))
            egress = [
                f"--egress-selector-config-file={d / 'egress.yaml'}",
                "--enable-aggregator-routing=true",
            ]
        _start([bins["apiserver"], *egress, f"--etcd-servers=http://127.0.0.1:{etcd_port}", "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1", f"--secure-port={api_port}", f"--cert-dir={d / 'certs'}",
                f"--token-auth-file={d / 'tokens.csv'}", "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={d / 'sa.pub'}", f"--service-account-signing-key-file={d / 'sa.key'}",
                "--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true",
                f"--audit-log-path={audit_log}", f"--audit-policy-file={d / 'audit-policy.yaml'}",
                "--audit-log-format=json"], d / "apiserver.log", procs)  # fmt: skip
        server = f"https://127.0.0.1:{api_port}"
        wait_until(lambda: _readyz(server), 60, "kube-apiserver /readyz")
        kubeconfig, operator_kubeconfig = d / "kubeconfig", d / "operator.kubeconfig"
        _kubeconfig(kubeconfig, server, ADMIN_TOKEN)
        _kubeconfig(operator_kubeconfig, server, OPERATOR_TOKEN)
        _start([bins["controller-manager"], f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
                "--leader-elect=false", "--use-service-account-credentials=false",
                f"--service-account-private-key-file={d / 'sa.key'}",
                f"--root-ca-file={d / 'certs' / 'apiserver.crt'}",
                "--controllers=*,-nodelifecycle,-cloud-node-lifecycle", "--bind-address=127.0.0.1",
                # --port=0: no insecure listener (1.20's default is 0.0.0.0:10252, which a second
                # tier on the machine cannot bind: its controller-manager then exits at once).
                f"--secure-port={kcm_port}", "--port=0"], d / "controller-manager.log", procs)  # fmt: skip
        c = Cluster(d, server, kubeconfig, operator_kubeconfig, audit_log, bins["kubectl"])
        c.kubectl("apply", "-f", "-", input=crd_yaml(cel=False))
        # Polled, not `kubectl wait`: that errors out at once while the CRD has no status yet.
        wait_until(lambda: _established(c), 60, "the CRD to be Established")
        c.kubectl("create", "namespace", "dsv4-system")
        yield c
    finally:
        stop_procs(procs)


def _established(c: Cluster) -> bool:
    conditions = (c.get("crd/dsv4deployments.dsv4.ai").get("status") or {}).get("conditions") or []
    return any(x.get("type") == "Established" and x.get("status") == "True" for x in conditions)
