"""The two bridges between the machine's namespace (loopback only: the API server, the tests) and the
node namespace (the pods). Bytes pass untouched both ways (TLS is end to end).

- `Relay` plays kube-proxy for the one Service pods need, `kubernetes`: it listens inside the node
  namespace on API_SERVICE_IP:443 and connects to the API server on 127.0.0.1.
- `EgressProxy` is the API server's way into the pod network, as Konnectivity is on clusters whose
  control plane sits on another network: the API server (its `--egress-selector-config-file`, the
  `cluster` selection) sends `CONNECT host:port` over a Unix socket, and the proxy connects from the
  node namespace. With `--enable-aggregator-routing` the API server resolves a Service to a Ready
  endpoint itself, so an admission webhook registered by Service reaches a pod behind it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading

from . import netns

log = logging.getLogger("agent.relay")


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class Relay:
    def __init__(self, ns: str, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.target = target
        with netns.entered(ns):
            self.sock = socket.create_server(listen, reuse_port=False)
        self._thread = threading.Thread(target=self._accept, name="relay", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection(self.target, timeout=10)
        except OSError:
            conn.close()
            return
        up.settimeout(None)
        back = threading.Thread(target=_pump, args=(up, conn), daemon=True)
        back.start()
        _pump(conn, up)
        back.join()
        conn.close()
        up.close()

    def close(self) -> None:
        self.sock.close()


class EgressProxy:
    """HTTP CONNECT on a Unix socket (the API server's `HTTPConnect` egress over `uds`), connecting
    from inside the namespace `ns`."""

    def __init__(self, ns: str, path: str) -> None:
        self.ns = ns
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.sock.bind(path)
        self.sock.listen(64)
        threading.Thread(target=self._accept, name="egress", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 8192:
            data = conn.recv(4096)
            if not data:
                conn.close()
                return
            head += data
        request, _, rest = head.partition(b"\r\n\r\n")
        method, target, *_ = request.split(b"\r\n", 1)[0].decode().split(" ")
        host, _, port = target.rpartition(":")
        try:
            if method != "CONNECT":
                raise OSError(f"not a CONNECT: {method}")
            with netns.entered(self.ns):
                up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            up.settimeout(10)
            up.connect((host, int(port)))
            up.settimeout(None)
        except (OSError, ValueError) as exc:
            log.warning("egress CONNECT %s refused: %s", target, exc)
            conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
            conn.close()
            return
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if rest:
            up.sendall(rest)
        back = threading.Thread(target=_pump, args=(up, conn), daemon=True)
        back.start()
        _pump(conn, up)
        back.join()
        conn.close()
        up.close()

    def close(self) -> None:
        self.sock.close()
