"""A container's probes, counted as the kubelet counts them (initial delay, period, success and
failure thresholds), run from the node namespace against the pod's address.

Time is compressed where it only slows tests down: startup and readiness probes run at most 1 s
apart (a 10 s period would add up to 10 s to every pod becoming Ready), their failure thresholds
scaled up to keep the time they allow (startup: the whole startup budget). Liveness keeps its real
period, and every timeout is at least 5 s: on a loaded 2-core machine a short one would kill or
unready healthy servers. exec probes are not supported (none of the pods here has one).
"""

from __future__ import annotations

import math
import socket
import time
from typing import Any

from . import netns

Obj = dict[str, Any]
COMPRESSED_PERIOD = 1.0
MIN_TIMEOUT = 5.0


def _port(port: int | str, container: Obj) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    return next(p["containerPort"] for p in container.get("ports") or [] if p.get("name") == port)


def check(spec: Obj, container: Obj, pod_ip: str, node_ns: str) -> bool:
    timeout = max(float(spec.get("timeoutSeconds", 1)), MIN_TIMEOUT)
    action = spec.get("httpGet") or spec.get("tcpSocket")
    if action is None:
        return False
    addr = (action.get("host") or pod_ip, _port(action["port"], container))
    try:
        with netns.entered(node_ns):  # the socket lives in the node namespace, as a kubelet's
            sock = socket.create_connection(addr, timeout=timeout)
        with sock:
            if "tcpSocket" in spec:
                return True
            sock.sendall(f"GET {action.get('path', '/')} HTTP/1.0\r\nHost: {addr[0]}\r\n\r\n".encode())
            line = sock.makefile("rb").readline().decode(errors="replace").split()
        return len(line) >= 2 and 200 <= int(line[1]) < 400
    except (OSError, ValueError):
        return False


class Probe:
    def __init__(self, spec: Obj, kind: str, started_at: float) -> None:
        self.spec, self.kind = spec, kind
        period = float(spec.get("periodSeconds", 10))
        delay = float(spec.get("initialDelaySeconds", 0))
        self.success_threshold = int(spec.get("successThreshold", 1))
        self.failure_threshold = int(spec.get("failureThreshold", 3))
        if kind != "liveness" and period > COMPRESSED_PERIOD:
            # More, faster probes, the same time before giving up (a startup budget stays whole).
            self.failure_threshold = math.ceil(self.failure_threshold * period / COMPRESSED_PERIOD)
            period, delay = COMPRESSED_PERIOD, min(delay, COMPRESSED_PERIOD)
        self.period = period
        self.next_at = started_at + delay
        self.successes = self.failures = 0

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool) -> str | None:
        """'success' or 'failure' when a threshold is crossed on this result, else None."""
        self.next_at = time.monotonic() + self.period
        if ok:
            self.failures, self.successes = 0, self.successes + 1
            return "success" if self.successes >= self.success_threshold else None
        self.successes, self.failures = 0, self.failures + 1
        return "failure" if self.failures >= self.failure_threshold else None
