"""`python -m agent --kubeconfig K --api HOST:PORT --model NAME=DIR... --state-dir S`: run one node.

It registers the Node, binds unscheduled pods to it (standing in for kube-scheduler, which this
tier does not build), relays the `kubernetes` Service to the API server, runs every pod bound to it
(pod.py), and enforces the NetworkPolicies' ingress rules between pods as a CNI would (netpol.py).
SIGTERM or SIGINT stops it: every pod's processes are killed and every namespace it made is deleted
(the rules with the node's), the Pods themselves left as a kubelet that goes away leaves them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx

from . import netns
from .api import Api
from .images import known_images
from .netpol import Enforcer
from .pod import PodWorker
from .relay import EgressProxy, Relay

Obj = dict[str, Any]
SYNC = 0.25  # seconds between pod lists: a small cluster, listed whole
log = logging.getLogger("agent")


def register_node(api: Api, name: str) -> Obj:
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    try:
        node = api.create(
            "/api/v1/nodes",
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}},
        )
    except FileExistsError:
        node = api.get(f"/api/v1/nodes/{name}")
    capacity = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}
    status = {
        "capacity": capacity,
        "allocatable": capacity,
        "addresses": [{"type": "InternalIP", "address": netns.GATEWAY}, {"type": "Hostname", "address": name}],
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test node agent"}],
        "nodeInfo": {"kubeletVersion": "v1.20.2-dsv4-test-agent", "operatingSystem": "linux", "architecture": "amd64",
                     "containerRuntimeVersion": "harness://0", "kubeProxyVersion": "", "osImage": "", "kernelVersion": "",
                     "machineID": "", "systemUUID": "", "bootID": ""},
    }  # fmt: skip
    api.merge_patch(f"/api/v1/nodes/{name}/status", {"status": status})
    return node


def fits(pod: Obj, node_labels: dict[str, str]) -> bool:
    wanted = pod["spec"].get("nodeSelector") or {}
    return all(node_labels.get(k) == v for k, v in wanted.items())


def bind(api: Api, pod: Obj, node: str) -> None:
    meta = pod["metadata"]
    body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}  # fmt: skip
    try:
        api.create(api.pod_path(pod, "/binding"), body)
        log.info("bound %s/%s to %s", meta["namespace"], meta["name"], node)
    except (KeyError, FileExistsError):
        pass  # deleted or bound meanwhile
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code != 403:
            raise
        # Its namespace is being deleted (no new content there): the pod goes with it.
        log.info("not binding %s/%s: %s", meta["namespace"], meta["name"], exc.response.json().get("message"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--api", required=True, help="the API server's HOST:PORT on loopback")
    ap.add_argument("--model", action="append", required=True, help="NAME=DIR: /opt/dsv4/models/NAME")
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--node-name", default="dsv4-test-node")
    ap.add_argument("--netns-prefix", default=f"dsv4c{os.getpid()}")
    ap.add_argument("--operator-release", action="append", default=[],
                    help="TAG=DIR: dsv4-operator:TAG is an earlier release (images.known_images)")  # fmt: skip
    ap.add_argument(
        "--egress-socket", help="serve the API server's egress (HTTP CONNECT) on this Unix socket"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    releases = dict(r.split("=", 1) for r in args.operator_release)
    api, images = Api(args.kubeconfig), known_images(dict(m.split("=", 1) for m in args.model), releases)
    net = netns.NodeNet(args.netns_prefix)
    workers: dict[str, PodWorker] = {}
    relay: Relay | None = None
    egress: EgressProxy | None = None
    try:
        host, port = args.api.rsplit(":", 1)
        relay = Relay(net.path, (netns.API_SERVICE_IP, 443), (host, int(port)))
        if args.egress_socket:
            egress = EgressProxy(net.path, args.egress_socket)
        node_labels = register_node(api, args.node_name)["metadata"].get("labels") or {}
        root = Path(args.state_dir) / "pods"
        policy = Enforcer(api, net.name, Path(args.state_dir) / "netpol.json")
        log.info("node %s up, netns %s", args.node_name, net.name)
        print("agent: ready", flush=True)
        while not stop.is_set():
            pods = api.pods()
            seen = set()
            for pod in pods:
                meta, spec = pod["metadata"], pod["spec"]
                uid = meta["uid"]
                if not spec.get("nodeName"):
                    if not meta.get("deletionTimestamp") and fits(pod, node_labels):
                        bind(api, pod, args.node_name)
                    continue
                if spec["nodeName"] != args.node_name:
                    continue
                seen.add(uid)
                worker = workers.get(uid)
                if meta.get("deletionTimestamp"):
                    if worker is None:  # nothing runs: remove it at once
                        api.delete(
                            api.pod_path(pod), {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
                        )
                    else:
                        worker.terminate(float(meta.get("deletionGracePeriodSeconds") or 0))
                elif worker is None:
                    workers[uid] = PodWorker(pod, api, net, images, root)
                    workers[uid].start()
                else:
                    worker.pod = pod  # labels and annotations can change (downward API reads them)
            for uid, worker in list(workers.items()):
                if uid not in seen:  # removed from the API (force-deleted): kill it now
                    worker.terminate(0, remove_from_api=False)
                if worker.done.is_set():
                    del workers[uid]
            try:
                policy.sync(pods, {uid: n.ip for uid, n in net.pods.copy().items()})
            except Exception:  # the API or nft failing now: the last rules stay, the next pass retries
                log.exception("network policy sync failed")
            stop.wait(SYNC)
    finally:
        for worker in workers.values():
            worker.terminate(0, remove_from_api=False)
        for worker in workers.values():
            worker.done.wait(60)
        if relay is not None:
            relay.close()
        if egress is not None:
            egress.close()
        net.close()
        log.info("agent stopped")


if __name__ == "__main__":
    main()
