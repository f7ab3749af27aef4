"""A TCP relay: listens inside a network namespace, connects from the caller's own (loopback).

It plays kube-proxy for the one Service pods need, `kubernetes`: pods dial API_SERVICE_IP:443 in
the node namespace and reach the API server on 127.0.0.1. Bytes pass untouched (TLS is end to end).
"""

from __future__ import annotations

import contextlib
import socket
import threading

from . import netns


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
