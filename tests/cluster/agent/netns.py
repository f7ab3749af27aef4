"""Network namespaces: one node namespace holding a bridge, one namespace per pod with a veth on it.

Every address here lives inside namespaces this module creates; the machine's own namespace only
ever sees loopback. A thread can join a namespace (`entered`, `enter`): sockets keep the namespace
they were created in, so one process can listen in the node namespace and connect on loopback.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
POD_CIDR = ipaddress.ip_network("10.244.0.0/24")
GATEWAY = "10.244.0.1"  # the bridge: pods' default route, the node's InternalIP
# The API server's cluster IP (first address of --service-cluster-ip-range): its serving certificate
# names it, so in-cluster clients verify TLS as on a real cluster. The relay listens there.
API_SERVICE_IP = "10.0.0.1"
BRIDGE_MAC = "02:00:0a:f4:00:01"  # locally administered, the gateway's address in it
_libc = ctypes.CDLL(None, use_errno=True)


def ns_path(name: str) -> str:
    return f"/run/netns/{name}"


def enter(path: str) -> None:
    """Move the calling thread (only it) into the network namespace at `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
    finally:
        os.close(fd)


@contextlib.contextmanager
def entered(path: str) -> Iterator[None]:
    """The calling thread inside `path` for the block, back in its own namespace after."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter(path)
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(own)


def ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def delete(name: str) -> None:
    """Kill what still runs in namespace `name`, then delete it (idempotent)."""
    if not os.path.exists(ns_path(name)):
        return
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:  # processes this harness started there and nothing else lives there
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@dataclass
class PodNet:
    netns: str
    ip: str
    veth: str


class NodeNet:
    """The node namespace `<prefix>-node` with bridge br0 (GATEWAY/24 plus API_SERVICE_IP/32)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.name = f"{prefix}-node"
        self.path = ns_path(self.name)
        self._next = 2  # never reuse an address: sglang-router keys workers by pod IP
        self.pods: dict[str, PodNet] = {}
        delete(self.name)
        ip("netns", "add", self.name)
        ip("-n", self.name, "link", "set", "lo", "up")
        # A fixed address: a bridge without one takes the lowest of its ports' (random) addresses, so
        # a new pod's veth could change it, and every pod's ARP entry for the gateway would point at
        # another pod's port until it expired (the node's probes unanswered for half a minute).
        ip("-n", self.name, "link", "add", "br0", "address", BRIDGE_MAC, "type", "bridge")
        ip("-n", self.name, "addr", "add", f"{GATEWAY}/{POD_CIDR.prefixlen}", "dev", "br0")
        ip("-n", self.name, "addr", "add", f"{API_SERVICE_IP}/32", "dev", "br0")
        ip("-n", self.name, "link", "set", "br0", "up")

    def add_pod(self, key: str) -> PodNet:
        n = self._next
        self._next += 1
        if n >= POD_CIDR.num_addresses - 1:
            raise RuntimeError("pod addresses exhausted")
        name, veth, addr = f"{self.prefix}-p{n}", f"vp{n}", str(POD_CIDR[n])
        delete(name)
        ip("netns", "add", name)
        ip("-n", self.name, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        ip("-n", self.name, "link", "set", veth, "master", "br0", "up")
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "addr", "add", f"{addr}/{POD_CIDR.prefixlen}", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "route", "add", "default", "via", GATEWAY)
        self.pods[key] = net = PodNet(name, addr, veth)
        return net

    def remove_pod(self, key: str) -> None:
        net = self.pods.pop(key, None)
        if net is not None:
            delete(net.netns)  # the veth goes with it

    def close(self) -> None:
        for key in list(self.pods):
            self.remove_pod(key)
        delete(self.name)
