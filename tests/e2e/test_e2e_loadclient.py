"""The e2e tier's in-cluster load client (loadclient.py), without a cluster: the script run exactly as
the load pod runs it (`python3 -c SOURCE URL WORKERS BODY`, here with its stop file in a temporary
folder) against a stand-in endpoint on 127.0.0.1 that answers, in turn, a good stream, an HTTP 503,
an error event and a stream cut before `[DONE]`; its log read back with `outcomes` and `finished`;
the load pod's manifest valid as Kubernetes' schema has it."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kubernetes_validate
import pytest
from e2ekube import InClusterLoad, Kube, wait_until
from loadclient import finished, outcomes

SOURCE = pathlib.Path(__file__).with_name("loadclient.py")
BODY = {"model": "dsv4-tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True}


def _event(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _delta(text: str) -> bytes:
    return _event({"choices": [{"index": 0, "delta": {"content": text}}]})


class Endpoint(BaseHTTPRequestHandler):
    """Answers the n-th request with ANSWERS[n % 4], streams chunked as uvicorn sends them; records
    each request's body."""

    protocol_version = "HTTP/1.1"
    ANSWERS = ("good", "503", "error-event", "cut")
    seen: list[dict]  # set per server below
    lock = threading.Lock()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with self.lock:
            self.seen.append(body)
            answer = self.ANSWERS[(len(self.seen) - 1) % len(self.ANSWERS)]
        if answer == "503":
            self.send_response(503)
            self.send_header("content-length", "17")
            self.end_headers()
            self.wfile.write(b"no ready workers.")
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        if answer == "cut":  # no length: the stream ends when the connection closes, early
            self.send_header("connection", "close")
            self.end_headers()
            self.wfile.write(_delta("hel") + _delta("lo"))
            self.close_connection = True
            return
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for data in (_delta("hel"), _delta("lo")):
            self._chunk(data)
        if answer == "good":
            self._chunk(_event({"choices": []}) + b"data: [DONE]\n\n")
        else:
            self._chunk(_event({"error": {"message": "KV transfer failed", "code": 502}}))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:  # quiet
        pass


@pytest.fixture
def endpoint() -> Iterator[tuple[str, list[dict]]]:
    seen: list[dict] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (Endpoint,), {"seen": seen}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_load_client_records_every_outcome_and_stops_after_its_requests(
    endpoint: tuple[str, list[dict]], tmp_path: pathlib.Path
) -> None:
    url, seen = endpoint
    stop = tmp_path / "stop"
    args = [sys.executable, "-c", SOURCE.read_text(), url, "2", json.dumps(BODY), str(stop)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: len(seen) >= 8, 60, "the load to send 8 requests")
        stop.touch()
        log, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, log
    log = "WARNING: a line the container wrote besides\n" + log
    got = outcomes(log)
    assert finished(log) and len(got) == len(seen), log
    assert {text for kind, text in got if kind == "ok"} == {"hello"}, got
    failures = sorted(text for kind, text in got if kind != "ok")
    assert {kind for kind, _ in got} == {"ok", "RuntimeError"}, got
    assert [f for f in failures if f.startswith("HTTP 503: no ready workers.")], failures
    assert [f for f in failures if "error event" in f and "KV transfer failed" in f], failures
    assert [f for f in failures if f == "the stream ended before [DONE] after 'hello'"], failures
    assert all(body == BODY for body in seen)  # the request as given


def test_a_log_without_its_done_line_is_not_finished() -> None:
    lines = [{"ok": True, "text": "a"}, {"ok": False, "error": "ConnectError", "message": "refused"}]
    log = "\n".join(json.dumps(r) for r in lines)
    assert outcomes(log) == [("ok", "a"), ("ConnectError", "refused")]
    assert not finished(log)
    assert finished(log + '\n{"done": 2}')
    assert not finished(log + '\n{"done": 3}')  # an outcome line lost: not the whole load


def test_the_load_pod_runs_the_script_and_validates() -> None:
    kube = Kube({"namespace": "dsv4-e2e", "engine": "localhost/dsv4/engine-cpu:0.1.0", "kubectl": "kubectl"})
    pod = InClusterLoad(kube, "http://dsv4-tiny.dsv4-e2e.svc:8000/v1", BODY)._manifest()
    kubernetes_validate.validate(pod, "1.30.0", strict=True)
    (c,) = pod["spec"]["containers"]
    assert c["command"][:2] == ["python3", "-c"] and c["command"][2] == SOURCE.read_text()
    assert c["command"][3:] == ["http://dsv4-tiny.dsv4-e2e.svc:8000/v1", "2", json.dumps(BODY)]
    assert pod["metadata"]["namespace"] == "dsv4-e2e" and pod["spec"]["restartPolicy"] == "Never"
