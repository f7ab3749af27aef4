"""One container of a pod: its process (started through podinit.py in the pod's namespaces), its
probes, restarts with back-off, and its entry in status.containerStatuses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import netns
from .probes import Probe, check

Obj = dict[str, Any]
PODINIT = Path(__file__).with_name("podinit.py")
MAX_BACKOFF = 10.0  # the kubelet's is 5 minutes; a test would only wait longer


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Container:
    def __init__(self, spec: Obj, pod_dir: Path) -> None:
        self.spec, self.name = spec, spec["name"]
        self.dir = pod_dir
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.started_at = ""
        self.started = self.ready = False
        self.waiting: Obj | None = {"reason": "ContainerCreating"}
        self.last: Obj = {}
        self.terminated: Obj | None = None
        self.restart_at = 0.0
        self.probes: dict[str, Probe] = {}

    # -- process ----------------------------------------------------------------------------
    def start(self, plan: Obj, pod_netns: str) -> None:
        plan = {**plan, "scratch": str(self.dir / f"{self.name}.overlay.{self.restarts}")}
        plan_path = self.dir / f"{self.name}.plan.json"
        plan_path.write_text(json.dumps(plan, indent=1))
        log = (self.dir / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(
            ["nsenter", f"--net={netns.ns_path(pod_netns)}", "--", "unshare", "--mount",
             "--propagation", "private", "--", sys.executable, str(PODINIT), str(plan_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, start_new_session=True,
        )  # fmt: skip
        log.close()
        self.started_at, self.waiting, self.terminated = now_rfc3339(), None, None
        self.started = not self.spec.get("startupProbe")
        self.ready = False
        t = time.monotonic()
        self.probes = {
            kind: Probe(self.spec[f"{kind}Probe"], kind, t)
            for kind in ("startup", "readiness", "liveness")
            if self.spec.get(f"{kind}Probe")
        }

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reap(self) -> bool:
        """True when the process has just exited: its terminated state recorded."""
        if self.proc is None or self.proc.poll() is None:
            return False
        code = self.proc.returncode
        exit_code = 128 - code if code < 0 else code  # killed by signal N: 128+N, as runtimes report
        self.terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": self.started_at,
            "finishedAt": now_rfc3339(),
            "containerID": f"harness://{self.proc.pid}",
        }
        if code < 0:
            self.terminated["signal"] = -code
        self.proc, self.started, self.ready = None, False, False
        return True

    def schedule_restart(self) -> None:
        self.last, self.terminated = {"terminated": self.terminated}, None
        self.restarts += 1
        self.restart_at = time.monotonic() + min(0.5 * 2 ** (self.restarts - 1), MAX_BACKOFF)
        self.waiting = {"reason": "CrashLoopBackOff", "message": "back-off restarting the container"}

    def signal(self, sig: int, group: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                if group:  # the runtime's cgroup kill: everything the container started
                    os.killpg(self.proc.pid, sig)
                else:  # the kubelet signals the container's main process
                    self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL, group=True)
        if self.proc is not None:
            self.proc.wait()

    # -- probes -----------------------------------------------------------------------------
    def probe(self, pod_ip: str, node_ns: str) -> str | None:
        """Run the probes that are due; 'restart' when startup or liveness failed for good."""
        if not self.running():
            return None
        t = time.monotonic()
        if not self.started:
            p = self.probes["startup"]
            if p.due(t):
                result = p.record(check(p.spec, self.spec, pod_ip, node_ns))
                if result == "success":
                    self.started = True
                elif result == "failure":
                    return "restart"
            return None
        p = self.probes.get("liveness")
        if p and p.due(t) and p.record(check(p.spec, self.spec, pod_ip, node_ns)) == "failure":
            return "restart"
        if (p := self.probes.get("readiness")) is None:
            self.ready = True
        elif p.due(t):
            result = p.record(check(p.spec, self.spec, pod_ip, node_ns))
            self.ready = {"success": True, "failure": False}.get(result or "", self.ready)
        return None

    # -- status -----------------------------------------------------------------------------
    def status(self) -> Obj:
        if self.running():
            state: Obj = {"running": {"startedAt": self.started_at}}
        elif self.terminated is not None:
            state = {"terminated": self.terminated}
        else:
            state = {"waiting": self.waiting or {"reason": "ContainerCreating"}}
        out: Obj = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restarts,
            "state": state,
            "lastState": self.last,
        }
        if self.proc is not None:
            out["containerID"] = f"harness://{self.proc.pid}"
        return out
