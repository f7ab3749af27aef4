"""One pod bound to this node, on its own thread: sandbox (network namespace), volumes, containers,
status; and termination as a kubelet does it: SIGTERM, the grace period, SIGKILL, then the Pod
removed from the API."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from . import podspec
from .api import Api
from .container import Container, now_rfc3339
from .images import Image, lookup
from .netns import API_SERVICE_IP, GATEWAY, NodeNet, PodNet

Obj = dict[str, Any]
TICK = 0.2  # how often a pod's processes and due probes are looked at
REPO = Path(__file__).resolve().parents[3]  # the checkout the venv's editable install points into
log = logging.getLogger("agent.pod")


class PodWorker:
    def __init__(self, pod: Obj, api: Api, net: NodeNet, images: dict[str, Image], root: Path) -> None:
        self.pod, self.api, self.net, self.images = pod, api, net, images
        self.uid = pod["metadata"]["uid"]
        self.key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        self.dir = root / self.uid
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sandbox: PodNet | None = None
        self.containers = [Container(c, self.dir) for c in pod["spec"]["containers"]]
        self.start_time = now_rfc3339()
        self._grace: float | None = None  # set: terminate within this many seconds
        self._remove_from_api = True
        self._last_status: str | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"pod {self.key}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def terminate(self, grace: float, remove_from_api: bool = True) -> None:
        if self._grace is None or grace < self._grace:
            self._grace, self._remove_from_api = grace, remove_from_api and self._remove_from_api

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.sandbox = self.net.add_pod(self.uid)
            while self._grace is None:
                self._tick()
                self._report()
                time.sleep(TICK)  # the kubelet's sync loop: a period, not a wait for an outcome
            self._stop(self._grace)
        except Exception:
            log.exception("pod %s failed in the agent", self.key)
            for c in self.containers:
                c.kill()
        finally:
            self.net.remove_pod(self.uid)
            if self._remove_from_api:
                self._delete_from_api()
            shutil.rmtree(self.dir / "volumes", ignore_errors=True)
            self.done.set()

    def _tick(self) -> None:
        assert self.sandbox is not None
        for c in self.containers:
            if c.reap():
                log.info("%s/%s exited %s", self.key, c.name, c.terminated)
                if self.pod["spec"].get("restartPolicy", "Always") == "Never" or (
                    self.pod["spec"].get("restartPolicy") == "OnFailure" and c.terminated["exitCode"] == 0
                ):
                    continue
                c.schedule_restart()
            if c.proc is None and c.terminated is None and time.monotonic() >= c.restart_at:
                self._start(c)
            if c.probe(self.sandbox.ip, self.net.path) == "restart":
                log.info("%s/%s failed its probe: restarting", self.key, c.name)
                c.kill()

    def _start(self, c: Container) -> None:
        assert self.sandbox is not None
        image = lookup(self.images, c.spec.get("image", ""))
        if image is None:
            c.waiting = {
                "reason": "ErrImageNeverPull",
                "message": f"image {c.spec.get('image')} unknown here",
            }
            c.restart_at = time.monotonic() + 5
            return
        try:
            env = podspec.container_env(self.pod, c.spec, image, self._get, self.sandbox.ip, GATEWAY)
            volumes = podspec.volume_dirs(self.pod, self.dir / "volumes", self._get)
            plan = {
                "argv": podspec.argv(c.spec, image, env),
                "env": env,
                "mounts": [*podspec.mounts(c.spec, volumes, image), self._hosts()],
                "workingDir": c.spec.get("workingDir") or "/",
                # What "the image" is on this machine: a volume mounted over a parent of these
                # (an emptyDir at /tmp, with the checkout under /tmp) must not hide them.
                "keep": [sys.prefix, str(REPO)],
            }
        except (podspec.PodError, KeyError) as exc:  # e.g. a Secret not created yet: retried
            c.waiting = {"reason": "CreateContainerConfigError", "message": str(exc)}
            c.restart_at = time.monotonic() + 1
            return
        log.info("%s/%s starting: %s", self.key, c.name, json.dumps(plan["argv"]))
        c.start(plan, self.sandbox.netns)

    def _hosts(self) -> Obj:
        """The kubelet-managed /etc/hosts, plus the `kubernetes` Service's names: this tier has no
        cluster DNS, and in-cluster clients (kopf) dial kubernetes.default.svc. Standing in for DNS,
        every other Service with a ready endpoint at the container's start is named too, resolving
        to one endpoint pod's address: right only where the Service port is the target port (there
        is no proxy), which holds for the Services a chart's `helm test` pod reaches."""
        assert self.sandbox is not None
        path = self.dir / "hosts"
        names = "kubernetes kubernetes.default kubernetes.default.svc kubernetes.default.svc.cluster.local"
        lines = [
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            f"{self.sandbox.ip}\t{self.pod['metadata']['name']}",
            f"{API_SERVICE_IP}\t{names}",
        ]
        own = self.pod["metadata"]["namespace"]
        for ep in self.api.get("/api/v1/endpoints").get("items", []):
            svc, ns = ep["metadata"]["name"], ep["metadata"]["namespace"]
            ips = [a["ip"] for s in ep.get("subsets") or [] for a in s.get("addresses") or []]
            if ips and (svc, ns) != ("kubernetes", "default"):
                short = f"{svc} {svc}.{ns} " if ns == own else f"{svc}.{ns} "
                lines.append(f"{ips[0]}\t{short}{svc}.{ns}.svc {svc}.{ns}.svc.cluster.local")
        path.write_text("\n".join(lines) + "\n")
        return {"source": str(path), "target": "/etc/hosts", "readOnly": False}

    def _get(self, kind: str, ns: str, name: str) -> Obj:
        return self.api.get(f"/api/v1/namespaces/{ns}/{kind}/{name}")

    def _stop(self, grace: float) -> None:
        log.info("%s: stopping (grace %.0fs)", self.key, grace)
        for c in self.containers:
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(c.running() for c in self.containers) and time.monotonic() < deadline:
            for c in self.containers:  # probes go on: a draining server turns unready, as on a kubelet
                if self.sandbox is not None:
                    c.probe(self.sandbox.ip, self.net.path)
            self._report()
            time.sleep(TICK)  # bounded by the grace period
        for c in self.containers:
            c.kill()
            c.reap()
        self._report()

    # -- status -----------------------------------------------------------------------------
    def _report(self) -> None:
        statuses = [c.status() for c in self.containers]
        ready = all(s["ready"] for s in statuses)
        running = any(c.started_at for c in self.containers)  # Running once a container has run

        def cond(kind: str, ok: bool) -> Obj:
            return {"type": kind, "status": "True" if ok else "False"}

        phase = "Running" if running else "Pending"
        policy = self.pod["spec"].get("restartPolicy", "Always")
        ended = [c.terminated for c in self.containers]
        if policy != "Always" and all(t is not None for t in ended):  # a pod that runs to an end
            if all(t["exitCode"] == 0 for t in ended):  # type: ignore[index]
                phase = "Succeeded"
            elif policy == "Never":
                phase = "Failed"
        status: Obj = {
            "phase": phase,
            "hostIP": GATEWAY,
            "podIP": self.sandbox.ip if self.sandbox else None,
            "podIPs": [{"ip": self.sandbox.ip}] if self.sandbox else None,
            "startTime": self.start_time,
            "conditions": [
                cond("Initialized", True),
                cond("Ready", ready),
                cond("ContainersReady", ready),
                cond("PodScheduled", True),
            ],
            "containerStatuses": statuses,
        }
        text = json.dumps(status, sort_keys=True)
        if text == self._last_status:
            return  # a sync that changes nothing writes nothing
        try:
            self.api.merge_patch(self.api.pod_path(self.pod, "/status"), {"status": status})
            self._last_status = text
        except KeyError:  # deleted meanwhile: the agent's loop will tell this worker
            pass
        except httpx.HTTPError as exc:  # a busy API server: sent again on the next tick
            log.warning("%s: status not written: %s", self.key, exc)

    def _delete_from_api(self) -> None:
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
        try:
            self.api.delete(self.api.pod_path(self.pod), body)
        except Exception as exc:  # already gone, or a newer pod of that name (uid precondition)
            log.info("%s: final delete: %s", self.key, exc)
